"""Sequence mixers: self- and cross-attention on one multi-head base (`heads`), and the
recurrent layers."""
