"""Strict numerics for every test: silent broadcasting or dtype promotion is a bug here. And one
JAX compilation cache shared by every process of the suite, XLA's quickest compilation for the
suite's own functions, one MLIR context per thread for JAX's lowerings, and a garbage collector
that runs less often (tests/environment.py)."""

import gc
import os

from environment import (
    collect_garbage_less_often,
    compile_quickly,
    enable_compilation_cache,
    fresh_mlir_context,
    share_one_mlir_context,
    trim_compilation_cache,
)

compile_quickly()  # before jax starts its backend

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
enable_compilation_cache()
share_one_mlir_context()


# The test files that take longest, longest first (seconds of one worker with empty compilation
# caches, measured on the 2-core AMD EPYC with tests/profile_suite.py, 2026-12-06): the suite's
# workers take whole files (`--dist=loadfile`) in collection order (with
# `--no-loadscope-reorder`, as the noxfile runs it; xdist otherwise sorts files by their number
# of tests), so when the longest go first the last files to run are short ones and neither worker
# waits on the other at the end.
LONGEST_FIRST = [  # worker-seconds of each file with empty caches (2026-12-06, evening)
    "test_architecture_artifacts.py",  # 467 (20 exports, each in JAX, IREE and C)
    "test_docs.py",  # 385
    "test_hf_architectures.py",  # 207
    "test_examples.py",  # 141
    "test_index_safety.py",  # 127
    "test_language_models.py",  # 125
    "test_paged.py",  # 108
    "test_iree.py",  # 102
    "test_export.py",  # 92
    "test_precision.py",  # 71
    "test_paged_kernel.py",  # 70 (the TPU's kernel in Pallas's interpret mode)
    "test_structured.py",  # 40
    "test_tools.py",  # 20
    "test_bad_inputs.py",  # 66
    "test_sequences.py",  # 57
    "test_serving.py",  # 52
    "test_prefill.py",  # 51
    "test_distributed.py",  # 51
    "test_runner.py",  # 48
    "test_recurrent.py",  # 41
    "test_http.py",  # 39
    "test_attention.py",  # 39
    "test_scan.py",  # 35
    "test_sharded_checkpoint.py",  # 33
    "test_blocked.py",  # 32
    "test_training.py",  # 26
    "test_gqa.py",  # 26
    "test_streaming.py",  # 23
    "test_rotary.py",  # 21
]


# What the quick tier (`pytest --quick`, `nox -s quick`) leaves out: the files that make artifacts
# through IREE or C, start other processes (distributed runs, the HTTP server, the pages' and
# examples' interpreters, sharded checkpoints' writers) or run every docs listing; every module
# is still imported and exercised by the unit tests left (tests/test_modules.py imports each).
NOT_QUICK = {
    "test_architecture_artifacts.py", "test_docs.py", "test_examples.py", "test_iree.py",
    "test_distributed.py", "test_runner.py", "test_index_safety.py", "test_device_lane.py",
    "test_http.py", "test_benchmark_table.py", "test_sharded_checkpoint.py",
    "test_mesh_generation.py", "test_sharded_export.py",
}  # fmt: skip
# ... and these tests of other files: artifacts through IREE or C, killed processes.
NOT_QUICK_TESTS = {
    "test_a_quantized_artifact_decodes_the_models_tokens_in_jax_iree_and_c",
    "test_no_sequence_of_kills_loses_the_last_complete_checkpoint",
    "test_a_replacement_killed_between_its_renames_leaves_the_old_artifact_loadable",
    "test_golden_data_and_the_standalone_runner_without_dense_armor",
    "test_cli_and_api_export_the_same_bytes_and_no_paths",  # two more exports each
    "test_the_seed_draws_the_golden_inputs_and_any_seed_is_checked_alike",
    "test_cli_export_and_inspect",  # the export's whole command line, more artifacts
    "test_an_artifact_samples_in_the_graph_as_generate_does",
    "test_cudnn_needs_a_gpu_but_exports_as_xla",
    "test_decoder_with_cross_attention_exports_forward_init_and_step",
    # artifacts through JAX are made by test_export.py in the quick tier; the other files'
    # exports of one configuration each wait for the whole gate
    "test_export_of_a_pre_ln_windowed_encoder",
    "test_export_of_a_bfloat16_encoder",
    "test_export_of_a_pre_ln_windowed_decoder",
    "test_checkpoints_convert_both_ways_and_export_works",
    "test_export_of_a_mixed_stack_matches_its_python_model",
    "test_a_multi_query_decoder_exports_and_matches_its_python_model",
    "test_a_grouped_rotary_windowed_model_exports_past_max_len",
    "test_import_torch_from_the_command_line_then_export",
    "test_non_causal_model_exports_the_step_of_its_causal_form",
    "test_float32_products_are_exported_at_full_precision",
    # one server's count of compilations after warm_up runs quick (test_logprobs.py's); these
    # loads of every kind, and the TPU kernel's whole server in Pallas's interpreter (its steps
    # against the gather path run quick), wait for the whole gate
    "test_nothing_compiles_after_warm_up_with_constrained_requests",
    "test_nothing_compiles_after_warm_up_whatever_the_load",
    "test_a_paged_server_through_the_kernel_gives_solo_greedy_tokens",
    # the precisions' end-to-end runs (their layers' checks run quick)
    "test_the_trained_byte_model_keeps_its_predictions_in_every_precision",
    "test_an_imported_checkpoint_keeps_its_predictions_in_every_precision",
    "test_a_quantized_bfloat16_model_saves_loads_generates_and_serves_alike",
    # the tool calls' grammar-forced decoding (the parsers and `auto` run quick), and the server
    # with a grammar (its masks against a constrained decoding from the full logits run quick)
    "test_a_demanded_call_is_the_constrained_greedy_one_and_valid",
    "test_constrained_tokens_are_the_constrained_greedy_decoding",
    # the server's other end-to-end runs: the command line's, the penalties' (against the NumPy
    # sampler through `generate` quick), a hybrid's and an int8 import's
    "test_the_cli_serves_json_lines_and_text_as_they_finish",
    "test_the_server_applies_penalties_as_generate_does",
    "test_a_hybrid_serves_from_pages_with_its_states_beside_them",
    "test_the_command_line_imports_low_and_decodes_with_an_int8_cache",
    # more of one kind: a narrow cache per family, a scanned twin, a long stream, a CPU budget
    "test_a_narrow_model_s_cache_is_in_its_dtype_and_loses_nothing",
    "test_a_scanned_model_quantizes_as_its_unrolled_twin",
    "test_a_rope_encoder_streams_like_its_forward",
    "test_a_huge_capacity_exports_with_a_bounded_golden_stream",
    "test_the_limit_is_the_smallest_counter_limit_and_a_ring_has_none",
    "test_a_mixture_of_experts_model_trains_with_its_balance_term",
    "test_checkpoints_and_artifacts_get_the_usual_permissions",
    "test_a_large_step_on_the_cpu_runs_in_micro_batches_with_the_whole_batch_gradient",
    # the warm-up's plan and counts of compilations beyond test_logprobs.py's (quick), the
    # kernel's batch of streams beyond its steps against the gather path (quick), the export for
    # every platform at once beyond the CPU's (quick)
    "test_the_fixed_slots_compile_the_warm_up_requests_functions_ahead",
    "test_requests_with_and_without_penalties_compile_nothing_after_warm_up",
    "test_a_batch_of_streams_runs_one_kernel_over_the_shared_pool",
    "test_every_platform_lowers_from_this_machine",
    "test_an_accelerator_is_held_to_the_manifest_s_own_tolerance",
    # a family's tokens through the server beside other requests (its logits against
    # transformers stay quick), sampled pages against the fixed slots (greedy pages stay quick)
    "test_the_server_gives_transformers_tokens_beside_other_requests",
    "test_sampled_paged_tokens_equal_the_fixed_slot_servers",
    # a scanned stack's pages (its kernel twin waits too; unrolled pages stay quick), a windowed
    # model's whole export past max_len (the refusal's cheap half is in the sweep of bad inputs)
    "test_a_scanned_model_serves_from_pages_token_exact",
    "test_export_refuses_a_capacity_past_max_len_unless_windowed",
}


# In the quick tier a parametrized test runs its first case only, except these, which run every
# case: one small check of each family against transformers.
QUICK_EVERY_CASE = {"test_the_logits_are_transformers_within_1e_5", "test_each_module_imports"}


def _quick(items):
    """The quick tier's items: `NOT_QUICK`'s files left out, and of each other parametrized
    test its first case (every case of `QUICK_EVERY_CASE`'s)."""
    kept, seen = [], set()
    for item in items:
        function = getattr(item, "originalname", item.name)
        if item.path.name in NOT_QUICK or function in NOT_QUICK_TESTS:
            continue
        if function in QUICK_EVERY_CASE or getattr(item, "callspec", None) is None:
            kept.append(item)
        elif (item.path, function) not in seen:
            seen.add((item.path, function))
            kept.append(item)
    return kept


def pytest_addoption(parser):
    parser.addoption(
        "--quick", action="store_true",
        help="the quick tier: NOT_QUICK's files left out, a parametrized test's first case only "
        "(tests/conftest.py)",
    )  # fmt: skip


def pytest_ignore_collect(collection_path, config):
    """With `--quick`, the files of `NOT_QUICK` not even imported (their modules bring the HTTP
    server's, IREE's and the distributed runs' imports: seconds of each worker's start)."""
    if config.getoption("quick") and collection_path.name in NOT_QUICK:
        return True
    return None


def pytest_collection_modifyitems(session, config, items):
    """The longest files first; the others after them, as collected; each file's own order
    kept (the sort is stable). With `--quick`, the files of `NOT_QUICK` deselected."""
    if config.getoption("quick"):
        kept = _quick(items)
        ids = {id(item) for item in kept}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in ids])
        items[:] = kept
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module", autouse=True)
def _fresh_heap_per_file():
    """After each file, JAX's in-memory caches emptied, a new MLIR context for the next file's
    lowerings and the garbage collected: a worker runs dozens of files, and what one file
    compiled (read back from the disk cache by the next file that needs it) made every later
    file's tracing slower as the heap grew (the suite's last files ran up to twice as slow as
    the same files run first)."""
    yield
    jax.clear_caches()
    fresh_mlir_context()
    gc.collect()


def pytest_configure(config):
    """`DENSE_ARMOR_TEST_PROFILE=DIRECTORY`: each worker's seconds per file and, of them, JAX's
    tracing, lowering and compiling (tests/profile_suite.py)."""
    directory = os.environ.get("DENSE_ARMOR_TEST_PROFILE")
    if directory:
        from profile_suite import Profile

        config.pluginmanager.register(Profile(directory), "dense_armor_profile")


def pytest_collection_finish(session):
    collect_garbage_less_often()  # the test modules imported: out of the collector's sight


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # once, in the controlling process
        trim_compilation_cache()


class KeyStream:
    """A fresh PRNG key at every call, from a fixed seed."""

    def __init__(self, seed: int = 0):
        self._key = jax.random.PRNGKey(seed)

    def __call__(self) -> jax.Array:
        self._key, sub = jax.random.split(self._key)
        return sub


@pytest.fixture
def getkey() -> KeyStream:
    return KeyStream()


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    """Strict promotion, except in tests marked `optax`: optax's own updates mix int and float."""
    mode = "standard" if request.node.get_closest_marker("optax") else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield
