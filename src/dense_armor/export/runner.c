/* runner.c: run a dense_armor artifact's static StableHLO modules from C through a PJRT plugin.

   The export stage copies this file into every artifact directory, beside XLA's PJRT C API
   header (pjrt_c_api.h, as the PJRT plugin wheels ship it). It needs libc, dlopen and that:

       cc -O2 -std=c11 -I ARTIFACT_DIR runner.c -ldl -lm -o runner
       ./runner ARTIFACT_DIR --plugin /path/to/xla_cpu_pjrt.so [--steps N] [--repeat R] [--cache DIR]

   It verifies the sha256 of every file the manifest lists, reads the weights from
   weights.safetensors once and keeps them on the device, compiles the static modules of the
   plugin's platform, and runs each golden case of manifest.golden.static: the forward,
   init_cache, prefill, reset, and a stream of `step` calls (or a language model's `sample_step`
   decoding) whose cache stays on the device from one call to the next, only each step's output
   coming back to the host. It prints the largest error against the Python model's outputs and
   the median latency of a step. `--steps N` past a stream's golden steps repeats its last input
   (a decoding feeds back its tokens) and checks each step past them against the overflow
   contract: a stream flagged `overflow` has NaN outputs, an unflagged one finite outputs, and a
   flagged stream's fixed key/value cache never changes. Exit status: 0 within the tolerance, 1
   beyond it (or off the contract), 2 for an unusable artifact, plugin or command line (a one-line
   `error: ...` on stderr), as run.py. `--cache DIR` (or DENSE_ARMOR_PJRT_CACHE=DIR) keeps each
   compiled module there, read back by the next run instead of compiled again. */

#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "pjrt_c_api.h"

#define FORMAT "dense_armor.export"
#define FORMAT_VERSION 2
#define MAX_DIMS 16

/* ------------------------------------------------------------------------------------------ */
/* Errors and memory                                                                           */

static void fail(const char *format, ...) {
  va_list args;
  va_start(args, format);
  fputs("error: ", stderr);
  vfprintf(stderr, format, args);
  fputc('\n', stderr);
  va_end(args);
  exit(2);
}

static void *checked_alloc(size_t n) {
  void *p = calloc(1, n ? n : 1);
  if (!p) fail("out of memory (%zu bytes)", n);
  return p;
}

static char *join_path(const char *directory, const char *name) {
  size_t n = strlen(directory) + strlen(name) + 2;
  char *path = checked_alloc(n);
  snprintf(path, n, "%s/%s", directory, name);
  return path;
}

typedef struct {
  unsigned char *data;
  size_t size;
} Bytes;

static int read_file(const char *path, Bytes *out) {
  FILE *f = fopen(path, "rb");
  if (!f) return 0;
  if (fseek(f, 0, SEEK_END) != 0) { fclose(f); return 0; }
  long n = ftell(f);
  if (n < 0 || fseek(f, 0, SEEK_SET) != 0) { fclose(f); return 0; }
  out->data = checked_alloc((size_t)n + 1); /* +1: a text file ends in NUL */
  out->size = fread(out->data, 1, (size_t)n, f);
  fclose(f);
  return out->size == (size_t)n;
}

static Bytes must_read(const char *path, const char *what) {
  Bytes b = {0};
  if (!read_file(path, &b)) fail("missing artifact file: %s (%s: %s)", path, what, strerror(errno));
  return b;
}

/* ------------------------------------------------------------------------------------------ */
/* JSON: a small parser for the manifest and the safetensors headers (every read bounded).      */

typedef enum { J_NULL, J_BOOL, J_NUMBER, J_STRING, J_ARRAY, J_OBJECT } JsonType;

typedef struct Json {
  JsonType type;
  double number;
  char *string;      /* J_STRING's value */
  char **keys;       /* J_OBJECT's keys */
  struct Json **items;
  size_t n;
} Json;

typedef struct {
  const char *start, *at, *end, *what;
  int depth;
} Parser;

static void json_fail(Parser *p, const char *message) {
  fail("%s is not valid JSON (%s at byte %ld).", p->what, message, (long)(p->at - p->start));
}

static void skip_space(Parser *p) {
  while (p->at < p->end && (*p->at == ' ' || *p->at == '\n' || *p->at == '\r' || *p->at == '\t'))
    p->at++;
}

static Json *json_value(Parser *p);

static char *json_string(Parser *p) {
  if (p->at >= p->end || *p->at != '"') json_fail(p, "expected a string");
  p->at++;
  size_t cap = 16, n = 0;
  char *s = checked_alloc(cap);
  while (1) {
    if (p->at >= p->end) json_fail(p, "unterminated string");
    char c = *p->at++;
    if (c == '"') break;
    if (c == '\\') {
      if (p->at >= p->end) json_fail(p, "unterminated escape");
      char e = *p->at++;
      switch (e) {
        case 'n': c = '\n'; break;
        case 't': c = '\t'; break;
        case 'r': c = '\r'; break;
        case 'b': c = '\b'; break;
        case 'f': c = '\f'; break;
        case 'u': { /* \uXXXX: kept as '?' beyond ASCII; names in a manifest are ASCII */
          if (p->end - p->at < 4) json_fail(p, "short \\u escape");
          unsigned v = 0;
          for (int i = 0; i < 4; i++) {
            char h = *p->at++;
            v = v * 16 + (unsigned)(h >= '0' && h <= '9' ? h - '0'
                                    : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                    : h >= 'A' && h <= 'F' ? h - 'A' + 10 : 0);
          }
          c = v < 128 ? (char)v : '?';
          break;
        }
        default: c = e; /* \" \\ \/ */
      }
    }
    if (n + 2 > cap) {
      cap *= 2;
      char *grown = realloc(s, cap);
      if (!grown) fail("out of memory");
      s = grown;
    }
    s[n++] = c;
  }
  s[n] = 0;
  return s;
}

static void json_push(Json *j, char *key, Json *item) {
  if ((j->n & (j->n - 1)) == 0) { /* grow at 0, 1, 2, 4, 8, ... */
    size_t cap = j->n ? 2 * j->n : 1;
    j->items = realloc(j->items, cap * sizeof *j->items);
    if (j->type == J_OBJECT) j->keys = realloc(j->keys, cap * sizeof *j->keys);
    if (!j->items || (j->type == J_OBJECT && !j->keys)) fail("out of memory");
  }
  if (j->type == J_OBJECT) j->keys[j->n] = key;
  j->items[j->n++] = item;
}

static Json *json_value(Parser *p) {
  skip_space(p);
  if (p->at >= p->end) json_fail(p, "unexpected end");
  if (++p->depth > 64) json_fail(p, "nested too deeply");
  Json *j = checked_alloc(sizeof *j);
  char c = *p->at;
  if (c == '{' || c == '[') {
    j->type = c == '{' ? J_OBJECT : J_ARRAY;
    char close = c == '{' ? '}' : ']';
    p->at++;
    skip_space(p);
    if (p->at < p->end && *p->at == close) {
      p->at++;
    } else {
      while (1) {
        char *key = NULL;
        skip_space(p);
        if (j->type == J_OBJECT) {
          key = json_string(p);
          skip_space(p);
          if (p->at >= p->end || *p->at != ':') json_fail(p, "expected ':'");
          p->at++;
        }
        json_push(j, key, json_value(p));
        skip_space(p);
        if (p->at < p->end && *p->at == ',') { p->at++; continue; }
        if (p->at < p->end && *p->at == close) { p->at++; break; }
        json_fail(p, "expected ',' or a closing bracket");
      }
    }
  } else if (c == '"') {
    j->type = J_STRING;
    j->string = json_string(p);
  } else if (p->end - p->at >= 4 && !strncmp(p->at, "true", 4)) {
    j->type = J_BOOL, j->number = 1, p->at += 4;
  } else if (p->end - p->at >= 5 && !strncmp(p->at, "false", 5)) {
    j->type = J_BOOL, j->number = 0, p->at += 5;
  } else if (p->end - p->at >= 4 && !strncmp(p->at, "null", 4)) {
    j->type = J_NULL, p->at += 4;
  } else if (c == '-' || (c >= '0' && c <= '9') || c == 'N' || c == 'I') {
    char buffer[64];
    size_t n = 0;
    while (p->at < p->end && n < sizeof buffer - 1 && strchr("+-0123456789.eEnfiNaIty", *p->at))
      buffer[n++] = *p->at++;
    buffer[n] = 0;
    char *stop;
    j->type = J_NUMBER;
    j->number = strtod(buffer, &stop);
    if (stop == buffer || *stop) json_fail(p, "bad number");
  } else {
    json_fail(p, "unexpected character");
  }
  p->depth--;
  return j;
}

static Json *json_parse(const char *text, size_t size, const char *what) {
  Parser p = {text, text, text + size, what, 0};
  Json *j = json_value(&p);
  skip_space(&p);
  if (p.at != p.end) json_fail(&p, "trailing characters");
  return j;
}

static Json *json_get(const Json *j, const char *key) {
  if (!j || j->type != J_OBJECT) return NULL;
  for (size_t i = 0; i < j->n; i++)
    if (!strcmp(j->keys[i], key)) return j->items[i];
  return NULL;
}

/* The manifest's value at `key`, of `type`, or a clear error naming where. */
static Json *need(const Json *j, const char *key, JsonType type, const char *where) {
  Json *v = json_get(j, key);
  if (!v) fail("manifest.json lacks the key `%s%s`: edited or truncated.", where, key);
  if (v->type != type && !(type == J_NUMBER && v->type == J_BOOL))
    fail("manifest.json: `%s%s` has the wrong type (edited?).", where, key);
  return v;
}

static long need_int(const Json *j, const char *key, const char *where) {
  double v = need(j, key, J_NUMBER, where)->number;
  if (v != floor(v) || fabs(v) > 1e15) fail("manifest.json: `%s%s` is not an integer.", where, key);
  return (long)v;
}

/* ------------------------------------------------------------------------------------------ */
/* SHA-256 (FIPS 180-4)                                                                         */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(uint32_t h[8], const unsigned char *block) {
  uint32_t w[64];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)block[4 * i] << 24 | (uint32_t)block[4 * i + 1] << 16 |
           (uint32_t)block[4 * i + 2] << 8 | block[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = ROTR(w[i - 15], 7) ^ ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ROTR(w[i - 2], 17) ^ ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = k + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
    uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
  }
  h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

static void sha256_hex(const unsigned char *data, size_t n, char out[65]) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  size_t i = 0;
  for (; i + 64 <= n; i += 64) sha256_block(h, data + i);
  unsigned char tail[128] = {0};
  size_t rest = n - i;
  memcpy(tail, data + i, rest);
  tail[rest] = 0x80;
  size_t blocks = rest + 9 > 64 ? 2 : 1;
  uint64_t bits = (uint64_t)n * 8;
  for (int j = 0; j < 8; j++) tail[blocks * 64 - 1 - j] = (unsigned char)(bits >> (8 * j));
  for (size_t j = 0; j < blocks; j++) sha256_block(h, tail + 64 * j);
  for (int j = 0; j < 8; j++) snprintf(out + 8 * j, 9, "%08x", h[j]);
}

/* ------------------------------------------------------------------------------------------ */
/* Element types: the manifest's names, safetensors' and StableHLO's, PJRT's                    */

typedef struct {
  const char *name, *safetensors, *mlir;
  PJRT_Buffer_Type pjrt;
  size_t size;
} DType;

static const DType DTYPES[] = {
    {"float32", "F32", "f32", PJRT_Buffer_Type_F32, 4},
    {"float64", "F64", "f64", PJRT_Buffer_Type_F64, 8},
    {"float16", "F16", "f16", PJRT_Buffer_Type_F16, 2},
    {"bfloat16", "BF16", "bf16", PJRT_Buffer_Type_BF16, 2},
    {"int8", "I8", "i8", PJRT_Buffer_Type_S8, 1},
    {"int16", "I16", "i16", PJRT_Buffer_Type_S16, 2},
    {"int32", "I32", "i32", PJRT_Buffer_Type_S32, 4},
    {"int64", "I64", "i64", PJRT_Buffer_Type_S64, 8},
    {"uint8", "U8", "ui8", PJRT_Buffer_Type_U8, 1},
    {"uint32", "U32", "ui32", PJRT_Buffer_Type_U32, 4},
    {"bool", "BOOL", "i1", PJRT_Buffer_Type_PRED, 1},
};
#define N_DTYPES (sizeof DTYPES / sizeof DTYPES[0])

static const DType *dtype_named(const char *name, int which) {
  for (size_t i = 0; i < N_DTYPES; i++) {
    const char *s = which == 0 ? DTYPES[i].name : which == 1 ? DTYPES[i].safetensors : DTYPES[i].mlir;
    if (!strcmp(s, name)) return &DTYPES[i];
  }
  return NULL;
}

static float half_to_float(uint16_t h) {
  int exponent = (h >> 10) & 31, mantissa = h & 1023;
  float v = exponent == 0    ? ldexpf((float)mantissa, -24)
            : exponent == 31 ? (mantissa ? NAN : INFINITY)
                             : ldexpf((float)(mantissa | 1024), exponent - 25);
  return h & 0x8000 ? -v : v;
}

/* Element `i` of `data` (of type `t`) as a double. */
static double element(const DType *t, const unsigned char *data, size_t i) {
  const unsigned char *p = data + i * t->size;
  switch (t->pjrt) {
    case PJRT_Buffer_Type_F32: { float v; memcpy(&v, p, 4); return v; }
    case PJRT_Buffer_Type_F64: { double v; memcpy(&v, p, 8); return v; }
    case PJRT_Buffer_Type_F16: { uint16_t v; memcpy(&v, p, 2); return half_to_float(v); }
    case PJRT_Buffer_Type_BF16: {
      uint16_t v; memcpy(&v, p, 2);
      uint32_t bits = (uint32_t)v << 16; float f; memcpy(&f, &bits, 4); return f;
    }
    case PJRT_Buffer_Type_S8: return (int8_t)p[0];
    case PJRT_Buffer_Type_S16: { int16_t v; memcpy(&v, p, 2); return v; }
    case PJRT_Buffer_Type_S32: { int32_t v; memcpy(&v, p, 4); return v; }
    case PJRT_Buffer_Type_S64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
    case PJRT_Buffer_Type_U8: return p[0];
    case PJRT_Buffer_Type_U32: { uint32_t v; memcpy(&v, p, 4); return v; }
    case PJRT_Buffer_Type_PRED: return p[0] != 0;
    default: return NAN;
  }
}

static uint16_t float_to_bfloat16(float f) { /* round to nearest even, NaN kept */
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if (isnan(f)) return (uint16_t)((bits >> 16) | 0x40);
  return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static uint16_t float_to_half(float f) { /* round to nearest even */
  uint32_t bits;
  memcpy(&bits, &f, 4);
  uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
  if (isnan(f)) return sign | 0x7e00;
  float a = fabsf(f);
  if (a >= 65520.0f) return sign | 0x7c00;
  if (a < ldexpf(1, -14)) return sign | (uint16_t)lrintf(a * ldexpf(1, 24));
  int e;
  float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
  uint32_t mantissa = (uint32_t)lrintf((m * 2 - 1) * 1024);
  uint32_t exponent = (uint32_t)(e - 1 + 15);
  if (mantissa == 1024) mantissa = 0, exponent++;
  return sign | (uint16_t)(exponent << 10 | mantissa);
}

/* ------------------------------------------------------------------------------------------ */
/* Arrays on the host, and safetensors files                                                    */

typedef struct {
  const char *name;
  const DType *dtype;
  int ndim;
  int64_t dims[MAX_DIMS];
  const unsigned char *data; /* into the file's bytes, or owned */
  size_t nbytes;
} Array;

static size_t count_of(const Array *a) {
  size_t n = 1;
  for (int i = 0; i < a->ndim; i++) n *= (size_t)a->dims[i];
  return n;
}

typedef struct {
  Array *arrays;
  size_t n;
  Bytes bytes;
} SafeTensors;

static SafeTensors read_safetensors(const char *path) {
  SafeTensors s = {0};
  s.bytes = must_read(path, "a safetensors file");
  if (s.bytes.size < 8) fail("unreadable safetensors file %s: shorter than its 8-byte header length.", path);
  uint64_t header = 0;
  for (int i = 7; i >= 0; i--) header = header << 8 | s.bytes.data[i];
  if (header > s.bytes.size - 8)
    fail("unreadable safetensors file %s: its header claims %llu bytes; the file has %zu after the "
         "length (truncated?).", path, (unsigned long long)header, s.bytes.size - 8);
  size_t described = strlen(path) + 64;
  char *what = checked_alloc(described);
  snprintf(what, described, "unreadable safetensors file %s: its header", path);
  Json *h = json_parse((const char *)s.bytes.data + 8, (size_t)header, what);
  if (h->type != J_OBJECT) fail("unreadable safetensors file %s: its header is not an object.", path);
  const unsigned char *base = s.bytes.data + 8 + header;
  size_t available = s.bytes.size - 8 - (size_t)header;
  s.arrays = checked_alloc(h->n * sizeof *s.arrays);
  for (size_t i = 0; i < h->n; i++) {
    if (!strcmp(h->keys[i], "__metadata__")) continue;
    Json *t = h->items[i], *dtype = json_get(t, "dtype"), *shape = json_get(t, "shape"),
         *offsets = json_get(t, "data_offsets");
    if (!dtype || dtype->type != J_STRING || !shape || shape->type != J_ARRAY || !offsets ||
        offsets->type != J_ARRAY || offsets->n != 2 || shape->n > MAX_DIMS)
      fail("unreadable safetensors file %s: bad entry for %s.", path, h->keys[i]);
    Array *a = &s.arrays[s.n++];
    a->name = h->keys[i];
    a->dtype = dtype_named(dtype->string, 1);
    if (!a->dtype) fail("%s: %s has the unsupported dtype %s.", path, a->name, dtype->string);
    a->ndim = (int)shape->n;
    size_t count = 1;
    for (size_t d = 0; d < shape->n; d++) {
      double v = shape->items[d]->number;
      if (shape->items[d]->type != J_NUMBER || v < 0 || v != floor(v) || v > 1e12)
        fail("unreadable safetensors file %s: bad shape for %s.", path, a->name);
      a->dims[d] = (int64_t)v;
      count *= (size_t)v;
    }
    double begin = offsets->items[0]->number, end = offsets->items[1]->number;
    if (offsets->items[0]->type != J_NUMBER || offsets->items[1]->type != J_NUMBER || begin < 0 ||
        end < begin || end > (double)available || end - begin != (double)(count * a->dtype->size))
      fail("unreadable safetensors file %s: the bytes of %s lie outside the file or do not match "
           "its shape (truncated or corrupted).", path, a->name);
    a->data = base + (size_t)begin;
    a->nbytes = (size_t)(end - begin);
  }
  return s;
}

static const Array *find_array(const SafeTensors *s, const char *name, const char *path) {
  for (size_t i = 0; i < s->n; i++)
    if (!strcmp(s->arrays[i].name, name)) return &s->arrays[i];
  fail("%s lacks the array %s (manifest edited?).", path, name);
  return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* PJRT                                                                                          */

static const PJRT_Api *api;
static PJRT_Client *client;
static PJRT_Device *device;
static const char *module_in_use = "";

static void check(PJRT_Error *error, const char *what) {
  if (!error) return;
  PJRT_Error_Message_Args m = {.struct_size = PJRT_Error_Message_Args_STRUCT_SIZE, .error = error};
  api->PJRT_Error_Message(&m);
  fail("%s%s%s: %.*s", module_in_use, *module_in_use ? ": " : "", what, (int)m.message_size,
       m.message);
}

/* Whether the call that returned `error` failed; its error destroyed (for what may fail quietly). */
static int failed_quietly(PJRT_Error *error) {
  if (!error) return 0;
  PJRT_Error_Destroy_Args e = {.struct_size = PJRT_Error_Destroy_Args_STRUCT_SIZE, .error = error};
  api->PJRT_Error_Destroy(&e);
  return 1;
}

static void await_event(PJRT_Event *event, const char *what) {
  if (!event) return;
  PJRT_Event_Await_Args a = {.struct_size = PJRT_Event_Await_Args_STRUCT_SIZE, .event = event};
  check(api->PJRT_Event_Await(&a), what);
  PJRT_Event_Destroy_Args d = {.struct_size = PJRT_Event_Destroy_Args_STRUCT_SIZE, .event = event};
  check(api->PJRT_Event_Destroy(&d), what);
}

static void destroy_buffer(PJRT_Buffer *buffer) {
  if (!buffer) return;
  PJRT_Buffer_Destroy_Args d = {.struct_size = PJRT_Buffer_Destroy_Args_STRUCT_SIZE, .buffer = buffer};
  check(api->PJRT_Buffer_Destroy(&d), "destroying a buffer");
}

static void load_plugin(const char *path, long recorded_major, long recorded_minor) {
  void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!handle) fail("cannot load the PJRT plugin %s: %s", path, dlerror());
  const PJRT_Api *(*get)(void) = (const PJRT_Api *(*)(void))dlsym(handle, "GetPjrtApi");
  if (!get) fail("%s has no GetPjrtApi: not a PJRT plugin.", path);
  api = get();
  if (!api) fail("%s: GetPjrtApi returned nothing.", path);
  int major = api->pjrt_api_version.major_version, minor = api->pjrt_api_version.minor_version;
  if (major != PJRT_API_MAJOR)
    fail("the plugin %s implements PJRT C API %d.%d; this runner was built against %d.%d: the "
         "major versions differ.", path, major, minor, PJRT_API_MAJOR, PJRT_API_MINOR);
  if (recorded_major >= 0 && major != recorded_major)
    fail("the plugin %s implements PJRT C API %d.%d; the artifact was checked with %ld.%ld: the "
         "major versions differ.", path, major, minor, recorded_major, recorded_minor);
  if (recorded_minor >= 0 && minor < recorded_minor)
    fprintf(stderr, "warning: the plugin %s implements PJRT C API %d.%d, older than the %ld.%ld "
            "the artifact was checked with.\n", path, major, minor, recorded_major, recorded_minor);
  PJRT_Plugin_Initialize_Args init = {.struct_size = PJRT_Plugin_Initialize_Args_STRUCT_SIZE};
  check(api->PJRT_Plugin_Initialize(&init), "initializing the plugin");
  PJRT_Client_Create_Args create = {.struct_size = PJRT_Client_Create_Args_STRUCT_SIZE};
  check(api->PJRT_Client_Create(&create), "creating a client");
  client = create.client;
  PJRT_Client_AddressableDevices_Args devices = {
      .struct_size = PJRT_Client_AddressableDevices_Args_STRUCT_SIZE, .client = client};
  check(api->PJRT_Client_AddressableDevices(&devices), "listing devices");
  if (devices.num_addressable_devices < 1) fail("the plugin %s has no device.", path);
  device = devices.addressable_devices[0];
}

static char *platform_name(void) {
  PJRT_Client_PlatformName_Args a = {.struct_size = PJRT_Client_PlatformName_Args_STRUCT_SIZE,
                                     .client = client};
  check(api->PJRT_Client_PlatformName(&a), "reading the platform's name");
  char *name = checked_alloc(a.platform_name_size + 1);
  memcpy(name, a.platform_name, a.platform_name_size);
  if (!strcmp(name, "gpu")) strcpy(name, "cuda"); /* jax's name for an NVIDIA GPU */
  return name;
}

/* An array to the device, converted to `type` first when the golden file holds it wider
   (safetensors' float32 for a bfloat16 or float16 input). */
static PJRT_Buffer *to_device(const Array *a, const DType *type) {
  const void *data = a->data;
  unsigned char *converted = NULL;
  if (type != a->dtype) {
    size_t n = count_of(a);
    converted = checked_alloc(n * type->size);
    for (size_t i = 0; i < n; i++) {
      float v = (float)element(a->dtype, a->data, i);
      uint16_t h = type->pjrt == PJRT_Buffer_Type_BF16 ? float_to_bfloat16(v) : float_to_half(v);
      memcpy(converted + 2 * i, &h, 2);
    }
    data = converted;
  }
  /* the host bytes' layout stated: row-major, each dimension's stride in bytes */
  int64_t strides[16];
  if (a->ndim > 16) fail("an input of %d dimensions (the runner writes up to 16)", a->ndim);
  int64_t stride = (int64_t)type->size;
  for (int i = a->ndim - 1; i >= 0; i--) {
    strides[i] = stride;
    stride *= a->dims[i];
  }
  PJRT_Client_BufferFromHostBuffer_Args b = {
      .struct_size = PJRT_Client_BufferFromHostBuffer_Args_STRUCT_SIZE,
      .client = client,
      .data = data,
      .type = type->pjrt,
      .dims = a->dims,
      .num_dims = (size_t)a->ndim,
      .byte_strides = strides,
      .num_byte_strides = (size_t)a->ndim,
      .host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableOnlyDuringCall,
      .device = device,
  };
  check(api->PJRT_Client_BufferFromHostBuffer(&b), "copying an input to the device");
  await_event(b.done_with_host_buffer, "copying an input to the device");
  free(converted);
  return b.buffer;
}

/* A device buffer's bytes on the host (`*size` of them), always row-major: the host layout is
   stated (dimensions major to minor, no tiles), never left to the device buffer's own, which
   XLA's TPU compiler may order otherwise (with a null `host_layout` the bytes would come back
   in that order). */
static unsigned char *to_host(PJRT_Buffer *buffer, size_t *size) {
  PJRT_Buffer_Dimensions_Args d = {.struct_size = PJRT_Buffer_Dimensions_Args_STRUCT_SIZE,
                                   .buffer = buffer};
  check(api->PJRT_Buffer_Dimensions(&d), "reading an output's dimensions");
  int64_t minor_to_major[16];
  if (d.num_dims > 16) fail("an output of %zu dimensions (the runner reads up to 16)", d.num_dims);
  for (size_t i = 0; i < d.num_dims; i++) minor_to_major[i] = (int64_t)(d.num_dims - 1 - i);
  PJRT_Buffer_MemoryLayout row_major = {
      .struct_size = PJRT_Buffer_MemoryLayout_STRUCT_SIZE,
      .tiled = {.struct_size = PJRT_Buffer_MemoryLayout_Tiled_STRUCT_SIZE,
                .minor_to_major = minor_to_major,
                .minor_to_major_size = d.num_dims,
                .num_tiles = 0},
      .type = PJRT_Buffer_MemoryLayout_Type_Tiled,
  };
  PJRT_Buffer_ToHostBuffer_Args a = {.struct_size = PJRT_Buffer_ToHostBuffer_Args_STRUCT_SIZE,
                                     .src = buffer,
                                     .host_layout = &row_major};
  check(api->PJRT_Buffer_ToHostBuffer(&a), "sizing an output");
  unsigned char *data = checked_alloc(a.dst_size);
  a.dst = data;
  check(api->PJRT_Buffer_ToHostBuffer(&a), "copying an output to the host");
  await_event(a.event, "copying an output to the host");
  *size = a.dst_size;
  return data;
}

typedef struct {
  PJRT_LoadedExecutable *loaded;
  size_t n_outputs;
  const char *path;
} Module;

/* The executable cache (`--cache DIR`, or the environment's DENSE_ARMOR_PJRT_CACHE): each module
   kept as the plugin serialized it once compiled, under the sha256 of everything that decides
   the compilation (the module's bytes, the compile options, XLA_FLAGS, and the plugin: its path,
   size and modification time, platform and platform version), and read back instead of compiled
   again. An entry holds the sha256 of its bytes first: one that does not match them (truncated,
   edited) is compiled again and replaced, never loaded. */
static const char *cache_dir = NULL;
static int compiled_count = 0, cached_count = 0;

/* What identifies the plugin and this process's XLA settings, read once per run. */
static char cache_head[512];
static int cache_head_size = -1;

static void cache_key(const Bytes *code, const char *options, size_t n_options, const char *plugin,
                      char key[65]) {
  const char *flags = getenv("XLA_FLAGS");
  if (!flags) flags = "";
  if (cache_head_size < 0) {
    struct stat st;
    if (stat(plugin, &st)) memset(&st, 0, sizeof st);
    PJRT_Client_PlatformVersion_Args v = {
        .struct_size = PJRT_Client_PlatformVersion_Args_STRUCT_SIZE, .client = client};
    check(api->PJRT_Client_PlatformVersion(&v), "reading the platform's version");
    int version = (int)(v.platform_version_size < 256 ? v.platform_version_size : 255);
    int n = snprintf(cache_head, sizeof cache_head, "%lld\n%lld\n%.*s\n%d.%d\n",
                     (long long)st.st_size, (long long)st.st_mtime, version, v.platform_version,
                     api->pjrt_api_version.major_version, api->pjrt_api_version.minor_version);
    cache_head_size = n < 0 || (size_t)n >= sizeof cache_head ? (int)strlen(cache_head) : n;
  }
  /* the plugin's path and the flags go in whole, each with its terminating zero */
  size_t parts[5] = {(size_t)cache_head_size, strlen(plugin) + 1, strlen(flags) + 1, n_options,
                     code->size};
  const void *from[5] = {cache_head, plugin, flags, options, code->data};
  size_t total = 0;
  for (int i = 0; i < 5; i++) total += parts[i];
  unsigned char *all = checked_alloc(total), *at = all;
  for (int i = 0; i < 5; i++) memcpy(at, from[i], parts[i]), at += parts[i];
  sha256_hex(all, total, key);
  free(all);
}

static PJRT_LoadedExecutable *cache_read(const char *key) {
  char name[80];
  snprintf(name, sizeof name, "%s.pjrt", key);
  char *path = join_path(cache_dir, name);
  Bytes entry = {0};
  PJRT_LoadedExecutable *loaded = NULL;
  if (read_file(path, &entry) && entry.size > 65 && entry.data[64] == '\n') {
    char digest[65];
    sha256_hex(entry.data + 65, entry.size - 65, digest);
    if (!memcmp(digest, entry.data, 64)) {
      PJRT_Executable_DeserializeAndLoad_Args d = {
          .struct_size = PJRT_Executable_DeserializeAndLoad_Args_STRUCT_SIZE, .client = client,
          .serialized_executable = (const char *)entry.data + 65,
          .serialized_executable_size = entry.size - 65};
      if (!failed_quietly(api->PJRT_Executable_DeserializeAndLoad(&d))) loaded = d.loaded_executable;
    }
  }
  free(entry.data);
  free(path);
  return loaded;
}

/* Written to a file of this process's own, then renamed over the entry: a reader never sees
   half of one. A plugin that cannot serialize, or a directory that cannot be written, costs
   only the cache. */
static void cache_write(const char *key, PJRT_Executable *executable) {
  PJRT_Executable_Serialize_Args a = {.struct_size = PJRT_Executable_Serialize_Args_STRUCT_SIZE,
                                      .executable = executable};
  if (failed_quietly(api->PJRT_Executable_Serialize(&a))) return;
  mkdir(cache_dir, 0777);
  char name[80], digest[65], temporary[96];
  snprintf(name, sizeof name, "%s.pjrt", key);
  snprintf(temporary, sizeof temporary, "%s.%ld.tmp", key, (long)getpid());
  char *path = join_path(cache_dir, name), *partial = join_path(cache_dir, temporary);
  sha256_hex((const unsigned char *)a.serialized_bytes, a.serialized_bytes_size, digest);
  FILE *f = fopen(partial, "wb");
  int ok = f && fwrite(digest, 1, 64, f) == 64 && fputc('\n', f) == '\n' &&
           fwrite(a.serialized_bytes, 1, a.serialized_bytes_size, f) == a.serialized_bytes_size;
  if (f) ok = !fclose(f) && ok;
  if (!ok || rename(partial, path)) {
    remove(partial);
    static int warned = 0;
    if (!warned++) fprintf(stderr, "warning: cannot write the executable cache %s: %s\n", cache_dir, strerror(errno));
  }
  a.serialized_executable_deleter(a.serialized_executable);
  free(path);
  free(partial);
}

static Module compile_module(const char *directory, const char *bytecode, const char *plugin) {
  Module m = {0};
  m.path = bytecode;
  char *path = join_path(directory, bytecode);
  Bytes code = must_read(path, "a static module");
  /* xla.CompileOptionsProto: executable_build_options { num_replicas: 1 num_partitions: 1 } */
  static const char options[] = {0x1a, 0x04, 0x20, 0x01, 0x28, 0x01};
  char key[65];
  int fresh = 0;
  module_in_use = bytecode;
  if (cache_dir) {
    cache_key(&code, options, sizeof options, plugin, key);
    m.loaded = cache_read(key);
  }
  if (m.loaded) cached_count++;
  else {
    PJRT_Program program = {.struct_size = PJRT_Program_STRUCT_SIZE, .code = (char *)code.data,
                            .code_size = code.size, .format = "mlir", .format_size = 4};
    PJRT_Client_Compile_Args c = {.struct_size = PJRT_Client_Compile_Args_STRUCT_SIZE,
                                  .client = client, .program = &program,
                                  .compile_options = options, .compile_options_size = sizeof options};
    check(api->PJRT_Client_Compile(&c), "compiling");
    m.loaded = c.executable;
    compiled_count++, fresh = 1;
  }
  PJRT_LoadedExecutable_GetExecutable_Args g = {
      .struct_size = PJRT_LoadedExecutable_GetExecutable_Args_STRUCT_SIZE, .loaded_executable = m.loaded};
  check(api->PJRT_LoadedExecutable_GetExecutable(&g), "reading the executable");
  if (cache_dir && fresh) cache_write(key, g.executable);
  PJRT_Executable_NumOutputs_Args n = {.struct_size = PJRT_Executable_NumOutputs_Args_STRUCT_SIZE,
                                       .executable = g.executable};
  check(api->PJRT_Executable_NumOutputs(&n), "counting the outputs");
  m.n_outputs = n.num_outputs;
  PJRT_Executable_Destroy_Args d = {.struct_size = PJRT_Executable_Destroy_Args_STRUCT_SIZE,
                                    .executable = g.executable};
  check(api->PJRT_Executable_Destroy(&d), "reading the executable");
  module_in_use = "";
  free(code.data);
  free(path);
  return m;
}

/* One call: `outputs` receives the module's `n_outputs` new device buffers. */
static void execute(const Module *m, PJRT_Buffer **inputs, size_t n_inputs, PJRT_Buffer **outputs) {
  PJRT_ExecuteOptions options = {.struct_size = PJRT_ExecuteOptions_STRUCT_SIZE};
  PJRT_Buffer *const *argument_lists[1] = {inputs};
  PJRT_Buffer **output_lists[1] = {outputs};
  PJRT_Event *done[1] = {NULL};
  PJRT_LoadedExecutable_Execute_Args e = {
      .struct_size = PJRT_LoadedExecutable_Execute_Args_STRUCT_SIZE,
      .executable = m->loaded, .options = &options, .argument_lists = argument_lists,
      .num_devices = 1, .num_args = n_inputs, .output_lists = output_lists,
      .device_complete_events = done};
  module_in_use = m->path;
  check(api->PJRT_LoadedExecutable_Execute(&e), "executing");
  await_event(done[0], "executing");
  module_in_use = "";
}

/* ------------------------------------------------------------------------------------------ */
/* The manifest's description of a function, and the check of a static module's signature      */

typedef struct {
  const char *name, *role;
  const DType *dtype;
  int ndim;
  int64_t dims[MAX_DIMS]; /* at the static sizes */
} Spec;

static Spec spec_of(const Json *s, const Json *sizes, const char *where) {
  Spec spec = {0};
  spec.name = need(s, "name", J_STRING, where)->string;
  Json *role = json_get(s, "role");
  spec.role = role && role->type == J_STRING ? role->string : "output";
  spec.dtype = dtype_named(need(s, "dtype", J_STRING, where)->string, 0);
  if (!spec.dtype) fail("manifest.json: %s has an unknown dtype.", spec.name);
  Json *shape = need(s, "shape", J_ARRAY, where);
  if (shape->n > MAX_DIMS) fail("manifest.json: %s has too many dimensions.", spec.name);
  spec.ndim = (int)shape->n;
  for (size_t d = 0; d < shape->n; d++) {
    Json *dim = shape->items[d];
    if (dim->type == J_STRING) {
      Json *size = json_get(sizes, dim->string);
      if (!size || size->type != J_NUMBER)
        fail("manifest.json: %s's dimension %s has no static size.", spec.name, dim->string);
      spec.dims[d] = (int64_t)size->number;
    } else if (dim->type == J_NUMBER) {
      spec.dims[d] = (int64_t)dim->number;
    } else {
      fail("manifest.json: %s has a bad shape.", spec.name);
    }
  }
  return spec;
}

static void describe(char *out, size_t n, const DType *dtype, int ndim, const int64_t *dims) {
  size_t used = (size_t)snprintf(out, n, "(");
  for (int d = 0; d < ndim && used < n; d++)
    used += (size_t)snprintf(out + used, n - used, "%s%lld", d ? ", " : "", (long long)dims[d]);
  if (used < n) snprintf(out + used, n - used, ") %s", dtype ? dtype->name : "?");
}

/* The `tensor<...>` types of one side of `func.func public @main(...) -> (...)` */
static int mlir_types(const char *from, const char *to, Spec *types, int max) {
  int n = 0;
  const char *at = from;
  while ((at = strstr(at, "tensor<")) && at < to) {
    at += 7;
    const char *close = strchr(at, '>');
    if (!close || close > to || n >= max) return -1;
    Spec *t = &types[n++];
    memset(t, 0, sizeof *t);
    const char *part = at;
    while (part < close) { /* 1x2x6x4xf32: the dims, then the element type */
      const char *x = part;
      while (x < close && *x != 'x') x++;
      if (x < close && t->ndim < MAX_DIMS && part[0] >= '0' && part[0] <= '9') {
        t->dims[t->ndim++] = strtoll(part, NULL, 10);
        part = x + 1;
      } else {
        char element[16] = {0};
        size_t len = (size_t)(close - part) < sizeof element - 1 ? (size_t)(close - part) : sizeof element - 1;
        memcpy(element, part, len);
        t->dtype = dtype_named(element, 2);
        break;
      }
    }
    at = close;
  }
  return n;
}

/* The manifest must say what the module takes and returns (its text's @main), as run.py --iree
   checks: an edited manifest is refused before anything runs. */
static void check_signature(const char *directory, const char *text, const Spec *inputs, int n_in,
                            const Spec *outputs, int n_out) {
  char *path = join_path(directory, text);
  Bytes module = must_read(path, "a static module's text");
  char *source = (char *)module.data;
  source[module.size] = 0;
  char *head = strstr(source, "func.func public @main(");
  if (!head) fail("%s has no `func.func public @main`: not jax's export.", text);
  char *body = strchr(head, '\n'), *arrow = strstr(head, ") -> "); /* one line: args -> results */
  if (!body) body = head + strlen(head);
  if (!arrow || arrow > body) fail("%s: cannot read @main's signature.", text);
  Spec *types = checked_alloc(4096 * sizeof *types);
  for (int side = 0; side < 2; side++) {
    int n = side ? mlir_types(arrow, body, types, 4096) : mlir_types(head, arrow, types, 4096);
    const Spec *specs = side ? outputs : inputs;
    int want = side ? n_out : n_in;
    if (n != want)
      fail("%s: the manifest lists %d %ss of this module; the module has %d (manifest edited?).",
           text, want, side ? "output" : "input", n);
    for (int i = 0; i < n; i++) {
      int same = types[i].dtype == specs[i].dtype && types[i].ndim == specs[i].ndim;
      for (int d = 0; same && d < types[i].ndim; d++) same = types[i].dims[d] == specs[i].dims[d];
      if (!same) {
        char claimed[256], actual[256];
        describe(claimed, sizeof claimed, specs[i].dtype, specs[i].ndim, specs[i].dims);
        describe(actual, sizeof actual, types[i].dtype, types[i].ndim, types[i].dims);
        fail("%s: the manifest says %s %s is %s; the module has %s (manifest edited?).", text,
             side ? "output" : "input", specs[i].name, claimed, actual);
      }
    }
  }
  free(types);
  free(module.data);
  free(path);
}

/* ------------------------------------------------------------------------------------------ */
/* Comparison                                                                                   */

/* The largest absolute difference between `got` (`type`, the bytes of a device output) and the
   golden array; NaN on both sides is equal (a stream past its capacity), on one side infinite.
   An int8 output (a quantized cache's rows) counts in units of its range, a level being 1/127. */
static double largest_error(const unsigned char *got, size_t got_size, const DType *type,
                            const Array *want, size_t offset, size_t count) {
  if (got_size != count * type->size) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < count; i++) {
    double a = element(type, got, i), b = element(want->dtype, want->data, offset + i);
    double d = isnan(a) && isnan(b) ? 0 : fabs(a - b);
    if (type->pjrt == PJRT_Buffer_Type_S8) d /= 127.0;
    if (isnan(d)) d = INFINITY;
    if (d > worst) worst = d;
  }
  return worst;
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

/* ------------------------------------------------------------------------------------------ */
/* The golden cases                                                                             */

typedef struct {
  const char *directory;
  Json *manifest;
  SafeTensors weights, golden;
  const char *platform;
  PJRT_Buffer **weight_buffers; /* in manifest.weights.names order */
  Json *weight_names;
  long steps, repeat;
  double worst;
  int printed;
} Run;

static void report(Run *run, const char *label, double error) {
  printf("  %-44s max |error| = %.3e\n", label, error);
  if (error > run->worst || isnan(error)) run->worst = isnan(error) ? INFINITY : error;
  run->printed++;
}

static PJRT_Buffer *weight_buffer(Run *run, const char *name) {
  for (size_t i = 0; i < run->weight_names->n; i++)
    if (!strcmp(run->weight_names->items[i]->string, name)) return run->weight_buffers[i];
  fail("manifest.json: the weight %s is not in weights.names (edited?).", name);
  return NULL;
}

/* A golden array `want` must match the manifest's spec, or the manifest or golden file was edited. */
static void check_golden_array(const Array *a, const Spec *s, int leading_steps, const char *where) {
  int ok = a->ndim == s->ndim + leading_steps;
  for (int d = 0, e = 0; ok && d < a->ndim; d++) {
    if (leading_steps && d == 1) continue; /* a stream's (B, steps, ...) */
    ok = a->dims[d] == s->dims[e++];
  }
  int float_kind = s->dtype->pjrt == PJRT_Buffer_Type_BF16 || s->dtype->pjrt == PJRT_Buffer_Type_F16;
  if (!ok || (a->dtype != s->dtype && !(float_kind && a->dtype->pjrt == PJRT_Buffer_Type_F32)))
    fail("%s: golden array %s does not fit the manifest's %s (edited?).", where, a->name, s->name);
}

/* A stream past its golden steps (--steps beyond them), its last input repeated (a decoding
   feeds back its tokens): each call checked against the manifest's overflow contract. A stream
   flagged `overflow` must have NaN outputs (a decoding's tokens are not checked), an unflagged one
   finite outputs, and a stream flagged before the call its fixed key/value cache unchanged. */
typedef struct {
  size_t batch, n_cache;
  int *fixed;          /* per cache array: part of a fixed key/value cache */
  unsigned char *was;  /* per stream: flagged before this call */
  long *first;         /* per stream: the step (from 1) its flag was first seen set; 0: never */
  unsigned char **before; /* the fixed cache arrays before this call, on the host */
  size_t *sizes;
  long broken;         /* streams off the contract, summed over the calls */
} Past;

static Past past_start(Json *manifest, const Spec *cache, size_t n_cache, size_t batch) {
  Past p = {.batch = batch, .n_cache = n_cache};
  p.fixed = checked_alloc(n_cache * sizeof *p.fixed);
  p.was = checked_alloc(batch), p.first = checked_alloc(batch * sizeof *p.first);
  p.before = checked_alloc(n_cache * sizeof *p.before), p.sizes = checked_alloc(n_cache * sizeof *p.sizes);
  Json *layout = json_get(json_get(manifest, "streaming"), "layout");
  for (size_t i = 0; i < n_cache && layout && layout->type == J_ARRAY; i++)
    for (size_t k = 0; k < layout->n; k++) {
      Json *path = json_get(layout->items[k], "path"), *holders = json_get(layout->items[k], "holders");
      if (path && path->type == J_STRING && !strcmp(path->string, cache[i].name) && holders &&
          holders->type == J_ARRAY && holders->n > 0 && holders->items[0]->type == J_STRING)
        p.fixed[i] = !strcmp(holders->items[0]->string, "FixedKVCache");
    }
  return p;
}

static void past_before(Past *p, PJRT_Buffer **cache) {
  for (size_t i = 0; i < p->n_cache; i++)
    if (p->fixed[i]) p->before[i] = to_host(cache[i], &p->sizes[i]);
}

static void past_after(Past *p, const unsigned char *y, size_t y_size, const DType *y_type, int tokens,
                       PJRT_Buffer **cache, PJRT_Buffer *flags_buffer, long step) {
  size_t size, per = y_size / y_type->size / p->batch;
  unsigned char *flags = to_host(flags_buffer, &size);
  unsigned char **after = checked_alloc(p->n_cache * sizeof *after);
  for (size_t i = 0; i < p->n_cache; i++)
    if (p->fixed[i]) after[i] = to_host(cache[i], &size);
  for (size_t b = 0; b < p->batch; b++) {
    int wrong = 0, rewritten = 0;
    for (size_t j = 0; !tokens && j < per; j++) {
      double v = element(y_type, y, b * per + j);
      wrong |= flags[b] ? !isnan(v) : !isfinite(v);
    }
    for (size_t i = 0; p->was[b] && i < p->n_cache; i++) {
      size_t slice = p->sizes[i] / p->batch;
      if (p->fixed[i]) rewritten |= memcmp(p->before[i] + b * slice, after[i] + b * slice, slice) != 0;
    }
    p->broken += wrong || rewritten;
    if (flags[b] && !p->first[b]) p->first[b] = step;
    p->was[b] = flags[b];
  }
  for (size_t i = 0; i < p->n_cache; i++)
    if (p->fixed[i]) free(after[i]), free(p->before[i]);
  free(after), free(flags);
}

static void past_report(Run *run, Past *p, const char *label, long extra, long golden_steps) {
  char where[256] = "", line[512];
  size_t used = 0;
  for (size_t b = 0, run; b < p->batch && used < sizeof where; b += run) {
    /* a run of neighbouring streams flagged at the same step: "streams 0-7 from step 9" */
    for (run = 1; b + run < p->batch && p->first[b + run] == p->first[b]; run++) {}
    if (!p->first[b]) continue;
    if (run == 1)
      used += (size_t)snprintf(where + used, sizeof where - used, "%sstream %zu from step %ld",
                               used ? ", " : "", b, p->first[b]);
    else
      used += (size_t)snprintf(where + used, sizeof where - used, "%sstreams %zu-%zu from step %ld",
                               used ? ", " : "", b, b + run - 1, p->first[b]);
  }
  snprintf(line, sizeof line, "%s, %ld steps past the golden %ld (overflow: %s; streams off contract)",
           label, extra, golden_steps, used ? where : "none");
  report(run, line, (double)p->broken);
}

static void past_free(Past *p) {
  free(p->fixed), free(p->was), free(p->first), free(p->before), free(p->sizes);
}

static void run_case(Run *run, Json *c, Json *entry, Module *module) {
  const char *function = need(c, "function", J_STRING, "golden.static[].")->string;
  Json *sizes = need(c, "shape", J_OBJECT, "golden.static[].");
  Json *fn = need(need(run->manifest, "functions", J_OBJECT, ""), function, J_OBJECT, "functions.");
  Json *in_specs = need(fn, "inputs", J_ARRAY, "functions.*."), *out_specs = need(fn, "outputs", J_ARRAY, "functions.*.");
  Json *inputs = need(c, "inputs", J_ARRAY, "golden.static[]."), *outputs = need(c, "outputs", J_ARRAY, "golden.static[].");
  Json *kept = need(entry, "kept_inputs", J_ARRAY, "static[].");
  Json *steps_json = json_get(c, "steps"), *feedback_json = json_get(c, "feedback");
  long steps = steps_json && steps_json->type == J_NUMBER ? (long)steps_json->number : 0;
  int feedback = feedback_json && feedback_json->type == J_BOOL && feedback_json->number;

  char label[256];
  size_t used = (size_t)snprintf(label, sizeof label, "pjrt %s", function);
  for (size_t i = 0; i < sizes->n && used < sizeof label; i++)
    used += (size_t)snprintf(label + used, sizeof label - used, " %s=%g", sizes->keys[i], sizes->items[i]->number);

  size_t n_in = in_specs->n, n_out = out_specs->n;
  Spec *specs = checked_alloc(n_in * sizeof *specs), *out = checked_alloc(n_out * sizeof *out);
  size_t n_weights = 0;
  for (size_t i = 0; i < n_in; i++) {
    specs[i] = spec_of(in_specs->items[i], sizes, "functions.*.inputs[].");
    n_weights += !strcmp(specs[i].role, "weight");
  }
  for (size_t i = 0; i < n_out; i++) out[i] = spec_of(out_specs->items[i], sizes, "functions.*.outputs[].");
  if (inputs->n != n_in - n_weights || outputs->n != n_out)
    fail("%s: the golden case lists %zu inputs and %zu outputs; the manifest's function has %zu "
         "and %zu (edited?).", label, inputs->n, outputs->n, n_in - n_weights, n_out);
  Spec *kept_specs = checked_alloc((kept->n + 1) * sizeof *kept_specs);
  for (size_t k = 0; k < kept->n; k++) {
    double v = kept->items[k]->number;
    if (kept->items[k]->type != J_NUMBER || v < 0 || v >= (double)n_in)
      fail("%s: static[].kept_inputs holds %g, not an input's index (manifest edited?).", label, v);
    kept_specs[k] = specs[(size_t)v];
  }
  check_signature(run->directory, need(entry, "text", J_STRING, "static[].")->string, kept_specs,
                  (int)kept->n, out, (int)n_out);
  if (module->n_outputs != n_out)
    fail("%s: the module returns %zu arrays; the manifest lists %zu outputs.", label, module->n_outputs, n_out);

  /* every input of the function: the weights' device buffers, then the golden inputs' */
  const Array **golden_in = checked_alloc(inputs->n * sizeof *golden_in);
  const Array **golden_out = checked_alloc(n_out * sizeof *golden_out);
  for (size_t i = 0; i < inputs->n; i++) {
    golden_in[i] = find_array(&run->golden, inputs->items[i]->string, "golden.safetensors");
    check_golden_array(golden_in[i], &specs[n_weights + i], steps && !feedback && i == 0, label);
  }
  for (size_t i = 0; i < n_out; i++) {
    golden_out[i] = find_array(&run->golden, outputs->items[i]->string, "golden.safetensors");
    check_golden_array(golden_out[i], &out[i], steps && i == 0, label);
  }
  PJRT_Buffer **every = checked_alloc(n_in * sizeof *every);
  for (size_t i = 0; i < n_weights; i++) every[i] = weight_buffer(run, specs[i].name);
  for (size_t i = 0; i < inputs->n; i++)
    every[n_weights + i] = steps && i == 0 && !feedback ? NULL : to_device(golden_in[i], specs[n_weights + i].dtype);
  PJRT_Buffer **args = checked_alloc((kept->n + 1) * sizeof *args);
  PJRT_Buffer **results = checked_alloc(n_out * sizeof *results);
  size_t size;

  if (!steps) { /* one call */
    for (size_t k = 0; k < kept->n; k++) args[k] = every[(size_t)kept->items[k]->number];
    execute(module, args, kept->n, results);
    double worst = 0;
    for (size_t i = 0; i < n_out; i++) {
      unsigned char *host = to_host(results[i], &size);
      double e = largest_error(host, size, out[i].dtype, golden_out[i], 0, count_of(golden_out[i]));
      if (e > worst || isnan(e)) worst = e;
      free(host);
      destroy_buffer(results[i]);
    }
    report(run, label, worst);
  } else { /* a stream: the cache (every input after the plain ones) stays on the device */
    size_t plain = 0;
    while (n_weights + plain < n_in && strcmp(specs[n_weights + plain].role, "cache")) plain++;
    size_t n_cache = n_in - n_weights - plain;
    if (n_out != n_cache + 2)
      fail("%s: a step returns its output, the cache and the overflow flags; the manifest lists "
           "%zu outputs for %zu cache arrays (edited?).", label, n_out, n_cache);
    long n = run->steps > 0 ? run->steps : steps; /* past `steps`: the last input again */
    const Array *xs = golden_in[0];
    size_t batch = (size_t)xs->dims[0], row = xs->dtype->size; /* bytes of one step of one stream */
    Past past = past_start(run->manifest, &specs[n_weights + plain], n_cache, batch);
    for (int d = 2; !feedback && d < xs->ndim; d++) row *= (size_t)xs->dims[d];
    double *latency = checked_alloc((size_t)(n * run->repeat) * sizeof *latency);
    double worst = 0, final = 0;
    long wrong = 0, timed = 0;
    PJRT_Buffer **start = checked_alloc(n_in * sizeof *start);
    memcpy(start, every, n_in * sizeof *every);
    for (long r = 0; r < run->repeat; r++) {
      memcpy(every, start, n_in * sizeof *every);
      PJRT_Buffer *fed = NULL; /* the token a decoding step returned, the next step's input */
      for (long t = 0; t < n; t++) {
        PJRT_Buffer *x_t = NULL;
        if (feedback) {
          if (t > 0) every[n_weights] = fed;
        } else { /* step t's rows of x (B, steps, ...) */
          Array slice = *xs;
          unsigned char *rows = checked_alloc(batch * row);
          for (size_t b = 0; b < batch; b++)
            memcpy(rows + b * row, xs->data + (b * (size_t)steps + (size_t)(t < steps ? t : steps - 1)) * row, row);
          slice.data = rows, slice.nbytes = batch * row, slice.ndim = xs->ndim - 1;
          for (int d = 1; d < slice.ndim; d++) slice.dims[d] = xs->dims[d + 1];
          x_t = to_device(&slice, specs[n_weights].dtype);
          free(rows);
          every[n_weights] = x_t;
        }
        for (size_t k = 0; k < kept->n; k++) args[k] = every[(size_t)kept->items[k]->number];
        int beyond = r == 0 && t >= steps;
        if (beyond) past_before(&past, &every[n_weights + plain]);
        double begin = now_us();
        execute(module, args, kept->n, results);
        unsigned char *y = to_host(results[0], &size); /* only the step's output comes back */
        latency[timed++] = now_us() - begin;
        size_t per_step = count_of(golden_out[0]) / (size_t)steps;
        if (beyond) past_after(&past, y, size, out[0].dtype, feedback, &results[1], results[n_out - 1], t + 1);
        else if (r == 0 && t == steps - 1) { /* the flags the first call past the golden starts from */
          size_t flag_size;
          unsigned char *flags = to_host(results[n_out - 1], &flag_size);
          memcpy(past.was, flags, flag_size < past.batch ? flag_size : past.batch);
          free(flags);
        }
        if (r == 0 && t < steps) {
          for (size_t b = 0; b < batch; b++) {
            size_t offset = (b * (size_t)steps + (size_t)t) * (per_step / batch);
            double e = largest_error(y + b * (per_step / batch) * out[0].dtype->size,
                                     (per_step / batch) * out[0].dtype->size, out[0].dtype,
                                     golden_out[0], offset, per_step / batch);
            if (feedback) wrong += e != 0;
            else if (e > worst || isnan(e)) worst = e;
          }
        }
        free(y);
        /* the new cache replaces the old one, on the device */
        for (size_t i = 0; i < n_cache; i++) {
          PJRT_Buffer **slot = &every[n_weights + plain + i];
          if (*slot != start[n_weights + plain + i]) destroy_buffer(*slot);
          *slot = results[1 + i];
        }
        if (x_t) destroy_buffer(x_t);
        if (feedback) {
          if (fed) destroy_buffer(fed);
          fed = results[0];
        } else {
          destroy_buffer(results[0]);
        }
        if (t == steps - 1 && r == 0) { /* the whole golden stream: its final cache and flags */
          for (size_t i = 1; i < n_out; i++) {
            unsigned char *host = to_host(results[i], &size);
            double e = largest_error(host, size, out[i].dtype, golden_out[i], 0, count_of(golden_out[i]));
            if (e > final || isnan(e)) final = e;
            free(host);
          }
        }
        destroy_buffer(results[n_out - 1]); /* the overflow flags: compared at the stream's end */
      }
      if (fed) destroy_buffer(fed);
      for (size_t i = 0; i < n_cache; i++) {
        PJRT_Buffer *b = every[n_weights + plain + i];
        if (b != start[n_weights + plain + i]) destroy_buffer(b);
      }
    }
    char line[320];
    if (feedback) {
      snprintf(line, sizeof line, "%s, %ld tokens (tokens that differ)", label, n < steps ? n : steps);
      report(run, line, (double)wrong);
    }
    snprintf(line, sizeof line, "%s, %ld steps", label, n < steps ? n : steps);
    report(run, line, worst > final ? worst : final);
    if (n > steps) past_report(run, &past, label, n - steps, steps);
    past_free(&past);
    qsort(latency, (size_t)timed, sizeof *latency, by_value);
    printf("  %-44s %.1f us per step (median of %ld, cache on the device)\n", "", latency[timed / 2], timed);
    memcpy(every, start, n_in * sizeof *every); /* the golden inputs, destroyed below */
    free(latency);
    free(start);
  }
  for (size_t i = 0; i < inputs->n; i++)
    if (every[n_weights + i] && (!steps || i > 0 || feedback)) destroy_buffer(every[n_weights + i]);
  free(specs), free(out), free(kept_specs), free(golden_in), free(golden_out), free(every), free(args), free(results);
}

/* ------------------------------------------------------------------------------------------ */

static void verify_files(const char *directory, Json *manifest) {
  Json *files = need(manifest, "files", J_OBJECT, "");
  for (size_t i = 0; i < files->n; i++) {
    char where[512];
    snprintf(where, sizeof where, "files[%s].", files->keys[i]);
    long bytes = need_int(files->items[i], "bytes", where);
    const char *digest = need(files->items[i], "sha256", J_STRING, where)->string;
    if (strstr(files->keys[i], "..")) fail("manifest.json lists the file %s outside the artifact.", files->keys[i]);
    char *path = join_path(directory, files->keys[i]);
    Bytes b = {0};
    if (!read_file(path, &b)) fail("missing artifact file: %s", path);
    if ((long)b.size != bytes)
      fail("%s has %zu bytes; the manifest says %ld (truncated or replaced).", path, b.size, bytes);
    char hex[65];
    sha256_hex(b.data, b.size, hex);
    if (strcmp(hex, digest)) fail("%s does not match its sha256 in the manifest (corrupted).", path);
    free(b.data);
    free(path);
  }
}

static void usage(void) {
  fputs("usage: runner ARTIFACT_DIR --plugin PJRT_PLUGIN.so [--steps N] [--repeat R] "
        "[--tolerance T] [--cache DIR]\n", stderr);
  exit(2);
}

int main(int argc, char **argv) {
  Run run = {0};
  const char *plugin = NULL;
  double tolerance = -1;
  run.repeat = 1;
  for (int i = 1; i < argc; i++) {
    char *stop;
    if (!strcmp(argv[i], "--plugin") && i + 1 < argc) plugin = argv[++i];
    else if (!strcmp(argv[i], "--cache") && i + 1 < argc) cache_dir = argv[++i];
    else if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
      run.steps = strtol(argv[++i], &stop, 10);
      if (*stop || run.steps < 1) fail("--steps must be a positive integer; received %s.", argv[i]);
    } else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) {
      run.repeat = strtol(argv[++i], &stop, 10);
      if (*stop || run.repeat < 1 || run.repeat > 100000) fail("--repeat must be a positive integer; received %s.", argv[i]);
    } else if (!strcmp(argv[i], "--tolerance") && i + 1 < argc) {
      tolerance = strtod(argv[++i], &stop);
      if (*stop || !(tolerance >= 0)) fail("--tolerance must be a non-negative number; received %s.", argv[i]);
    } else if (argv[i][0] != '-' && !run.directory) run.directory = argv[i];
    else usage();
  }
  if (!run.directory || !plugin) usage();
  if (!cache_dir && getenv("DENSE_ARMOR_PJRT_CACHE") && *getenv("DENSE_ARMOR_PJRT_CACHE"))
    cache_dir = getenv("DENSE_ARMOR_PJRT_CACHE");

  char *manifest_path = join_path(run.directory, "manifest.json");
  Bytes text = {0};
  if (!read_file(manifest_path, &text))
    fail("%s has no manifest.json: not a dense_armor artifact directory.", run.directory);
  run.manifest = json_parse((const char *)text.data, text.size, manifest_path);
  Json *m = run.manifest, *format = json_get(m, "format");
  if (m->type != J_OBJECT || !format || format->type != J_STRING || strcmp(format->string, FORMAT))
    fail("%s is not a dense_armor export manifest.", manifest_path);
  if (need_int(m, "format_version", "") != FORMAT_VERSION)
    fail("%s has format version %ld; this runner reads version %d: export the model again.",
         manifest_path, need_int(m, "format_version", ""), FORMAT_VERSION);
  Json *mesh = json_get(m, "mesh"); /* a model laid out over several devices: not one's runner */
  if (mesh && mesh->type != J_NULL && need_int(mesh, "devices", "mesh.") > 1)
    fail("%s: this artifact's modules are laid out for %ld devices (manifest.json's mesh); this "
         "runner runs one device's modules. Check it with `python run.py %s` (jax, the devices "
         "simulated on the CPU where there are fewer), or export the model without a mesh for "
         "this runtime.", run.directory, need_int(mesh, "devices", "mesh."), run.directory);
  Json *weights = need(m, "weights", J_OBJECT, ""), *golden = need(m, "golden", J_OBJECT, "");
  Json *static_entries = need(m, "static", J_ARRAY, "");
  Json *cases = need(golden, "static", J_ARRAY, "golden.");
  run.weight_names = need(weights, "names", J_ARRAY, "weights.");
  verify_files(run.directory, m);

  long recorded_major = -1, recorded_minor = -1;
  Json *pjrt = json_get(m, "pjrt");
  Json *version = pjrt ? json_get(pjrt, "api_version") : NULL; /* null: exported without one */
  if (version && version->type != J_NULL) {
    if (version->type != J_ARRAY || version->n != 2 || version->items[0]->type != J_NUMBER ||
        version->items[1]->type != J_NUMBER)
      fail("manifest.json: `pjrt.api_version` must be [major, minor] (edited?).");
    recorded_major = (long)version->items[0]->number, recorded_minor = (long)version->items[1]->number;
  }
  load_plugin(plugin, recorded_major, recorded_minor);
  run.platform = platform_name();

  char *weights_path = join_path(run.directory, need(weights, "file", J_STRING, "weights.")->string);
  char *golden_path = join_path(run.directory, need(golden, "file", J_STRING, "golden.")->string);
  run.weights = read_safetensors(weights_path);
  run.golden = read_safetensors(golden_path);

  /* the weights go to the device once; every call of every module reads them there */
  Json *first = NULL;
  for (size_t i = 0; i < static_entries->n && !first; i++) {
    Json *platform = json_get(static_entries->items[i], "platform");
    if (platform && platform->type == J_STRING && !strcmp(platform->string, run.platform)) first = static_entries->items[i];
  }
  if (!first)
    fail("%s has no static modules for %s: export it with platforms including \"%s\" and "
         "static shapes.", run.directory, run.platform, run.platform);
  run.weight_buffers = checked_alloc(run.weight_names->n * sizeof *run.weight_buffers);
  Json *any_function = need(m, "functions", J_OBJECT, "");
  for (size_t i = 0; i < run.weight_names->n; i++) {
    if (run.weight_names->items[i]->type != J_STRING) fail("manifest.json: weights.names holds a non-string.");
    const char *name = run.weight_names->items[i]->string;
    const Array *a = find_array(&run.weights, name, weights_path);
    const DType *type = a->dtype; /* the manifest's dtype for it, where a function lists it */
    for (size_t f = 0; f < any_function->n; f++) {
      Json *ins = json_get(any_function->items[f], "inputs");
      for (size_t k = 0; ins && k < ins->n; k++) {
        Json *n = json_get(ins->items[k], "name"), *d = json_get(ins->items[k], "dtype");
        if (n && d && n->type == J_STRING && d->type == J_STRING && !strcmp(n->string, name)) {
          type = dtype_named(d->string, 0);
          if (!type || (type != a->dtype && a->dtype->pjrt != PJRT_Buffer_Type_F32))
            fail("%s holds %s as %s; the manifest says %s.", weights_path, name, a->dtype->name, d->string);
        }
      }
    }
    run.weight_buffers[i] = to_device(a, type);
  }

  printf("artifact %s on PJRT plugin %s (%s, PJRT C API %d.%d)\n", run.directory, plugin, run.platform,
         api->pjrt_api_version.major_version, api->pjrt_api_version.minor_version);
  fflush(stdout);
  Module *modules = checked_alloc(static_entries->n * sizeof *modules);
  for (size_t i = 0; i < cases->n; i++) {
    Json *c = cases->items[i];
    const char *function = need(c, "function", J_STRING, "golden.static[].")->string;
    Json *shape = need(c, "shape", J_OBJECT, "golden.static[].");
    size_t e = 0;
    for (; e < static_entries->n; e++) { /* this platform's module of the case's function and shape */
      Json *entry = static_entries->items[e], *f = json_get(entry, "function"), *p = json_get(entry, "platform"),
           *s = json_get(entry, "shape");
      if (!f || !p || !s || f->type != J_STRING || p->type != J_STRING || s->type != J_OBJECT) continue;
      int same = !strcmp(f->string, function) && !strcmp(p->string, run.platform) && s->n == shape->n;
      for (size_t k = 0; same && k < s->n; k++) {
        Json *v = json_get(shape, s->keys[k]);
        same = v && v->type == J_NUMBER && v->number == s->items[k]->number;
      }
      if (same) break;
    }
    if (e == static_entries->n) continue; /* a case of another platform's modules */
    Json *entry = static_entries->items[e];
    const char *bytecode = need(entry, "bytecode", J_STRING, "static[].")->string;
    for (size_t k = 0; k < e && !modules[e].loaded; k++) /* a module listed twice: compiled once */
      if (modules[k].loaded && !strcmp(modules[k].path, bytecode)) modules[e] = modules[k];
    if (!modules[e].loaded) modules[e] = compile_module(run.directory, bytecode, plugin);
    run_case(&run, c, entry, &modules[e]);
    fflush(stdout);
  }
  if (!run.printed) fail("%s has no golden cases for its %s modules.", run.directory, run.platform);

  if (tolerance < 0) { /* run.py's defaults: half precision is compared with its round-off */
    Json *given = json_get(json_get(m, "precision"), "tolerance");
    Json *accelerator = json_get(json_get(m, "precision"), "accelerator_tolerance");
    if (!given || given->type != J_NUMBER) fail("the manifest has no precision.tolerance.");
    tolerance = given->number;
    /* an accelerator's float32 transcendentals are approximations: the manifest says how far */
    if (strcmp(run.platform, "cpu") && accelerator && accelerator->type == J_NUMBER)
      tolerance = accelerator->number;
  }
  int ok = run.worst <= tolerance;
  if (cache_dir)
    printf("  modules: %d compiled, %d read from the cache %s\n", compiled_count, cached_count, cache_dir);
  printf("  %-44s max |error| = %.3e (%s)\n", "all", run.worst, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
