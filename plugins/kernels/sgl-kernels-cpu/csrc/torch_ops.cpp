// The CPU implementations of sgl's kernel operators (namespace `sgl`, declared by the core in
// sgl/kernels/ops.py with pure-torch reference implementations), and this library's own
// controls (namespace `sgl_cpu`: level, threads, recording, replay).
//
// Each operator checks its tensors, allocates its output, and hands the call to the kernel of
// the level as one sgl_op (run_op.c). While this thread records (sgl_cpu::record_begin ..
// record_end), every op is also kept with the tensors it reads and writes, so that sgl_cpu::replay can run the same calls again
// on whatever those tensors hold then (sgl.engine.cpu_graph), without Python or the dispatcher.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_kernels.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// --- the level (set once at start-up by sgl.kernels.cpu) -------------------------------------

enum Level { AMX = 0, AVX512_BF16 = 1, AVX512 = 2, AVX2 = 3 };
Level g_level = AVX512;
bool g_bf16_dot_matmul = false;  // the bfloat16 matmul without AMX on vdpbf16ps (AMD)

// `emulated`: the AVX-512 levels' kernels in software (kernels_avx512_emulated.c), for tests
// of those levels on a CPU without them.
void set_level(std::string level, bool bf16_dot_matmul, bool emulated) {
  TORCH_CHECK_VALUE(!emulated || sgl_emulation_available(),
                    "sgl_cpu::set_level: this build of sgl-kernels-cpu cannot emulate the "
                    "AVX-512 levels (it was compiled without SIMDe's headers: install Debian's "
                    "libsimde-dev and reinstall the plugin)");
  if (level == "amx") {
    g_level = AMX;
  } else if (level == "avx512_bf16") {
    g_level = AVX512_BF16;
  } else if (level == "avx512") {
    g_level = AVX512;
  } else if (level == "avx2") {
    g_level = AVX2;
  } else {
    TORCH_CHECK_VALUE(false, "sgl_cpu::set_level: no kernels at level '", level,
                      "' (expected amx, avx512_bf16, avx512 or avx2)");
  }
  g_bf16_dot_matmul = bf16_dot_matmul && g_level == AVX512_BF16;
  sgl_set_emulation(emulated && g_level != AVX2);
}

bool emulation() { return sgl_emulation_available() != 0; }

std::string level() {
  switch (g_level) {
    case AMX:
      return "amx";
    case AVX512_BF16:
      return "avx512_bf16";
    case AVX512:
      return "avx512";
    default:
      return "avx2";
  }
}

// The kernel of an op at the level: its AVX-512 kind, or the AVX2 one with the same arguments.
int64_t at_level(int64_t avx512_kind, int64_t avx2_kind) {
  return g_level == AVX2 ? avx2_kind : avx512_kind;
}

int64_t set_threads(int64_t threads) {
  return sgl_set_threads(static_cast<int>(threads < 1 ? 1 : threads > 1024 ? 1024 : threads));
}

int64_t version() { return sgl_kernels_version(); }

// --- recording -------------------------------------------------------------------------------

struct Tape {
  bool on = false;
  std::vector<sgl_op> ops;
  std::vector<Tensor> inputs;   // what the ops read (weights, activations, tables)
  std::vector<Tensor> outputs;  // what the ops allocated
  // A uint8 block the ops' outputs are carved from while recording (undefined: each its own
  // allocation), and the bytes carved so far: counted with or without a block, so that a first
  // recording says how large a block its forward needs. An output that does not fit in the
  // block is allocated on its own.
  Tensor arena;
  int64_t arena_used = 0;
};

thread_local Tape tape;

void record_begin(const OptTensor& arena) {
  TORCH_CHECK(!tape.on, "sgl_cpu::record_begin: this thread is already recording");
  if (arena.has_value())
    TORCH_CHECK_VALUE(arena->device().is_cpu() && arena->scalar_type() == at::kByte &&
                          arena->dim() == 1 && arena->is_contiguous(),
                      "sgl_cpu::record_begin: the arena must be a contiguous 1-D uint8 CPU "
                      "tensor");
  tape = Tape{};
  tape.on = true;
  if (arena.has_value()) tape.arena = *arena;
}

std::tuple<Tensor, std::vector<Tensor>, std::vector<Tensor>, int64_t> record_end() {
  TORCH_CHECK(tape.on, "sgl_cpu::record_end: this thread is not recording");
  const int64_t n = static_cast<int64_t>(tape.ops.size());
  Tensor ops = at::empty({n, 1 + SGL_OP_ARGS}, at::kLong);
  static_assert(sizeof(sgl_op) == (1 + SGL_OP_ARGS) * sizeof(int64_t), "sgl_op has padding");
  if (n) std::memcpy(ops.data_ptr<int64_t>(), tape.ops.data(), n * sizeof(sgl_op));
  auto result = std::make_tuple(ops, std::move(tape.inputs), std::move(tape.outputs),
                                tape.arena_used);
  tape = Tape{};
  return result;
}

// An op's output: while recording, the next 64-byte aligned bytes of the arena where they fit
// (a replay of any recording that shares the arena overwrites it: the recorded forwards write
// every output before they read it); otherwise a tensor of its own.
Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!tape.on) return at::empty(sizes, options);
  const int64_t bytes = c10::multiply_integers(sizes) * static_cast<int64_t>(
                                                            options.dtype().itemsize());
  const int64_t start = (tape.arena_used + 63) / 64 * 64;
  tape.arena_used = start + bytes;
  if (!tape.arena.defined() || start + bytes > tape.arena.numel() || bytes == 0)
    return at::empty(sizes, options);
  return tape.arena.narrow(0, start, bytes)
      .view(options.dtype().toScalarType())
      .view(sizes);
}

int64_t replay(const Tensor& ops) {
  TORCH_CHECK_VALUE(ops.device().is_cpu() && ops.scalar_type() == at::kLong && ops.dim() == 2 &&
                        ops.size(1) == 1 + SGL_OP_ARGS && ops.is_contiguous(),
                    "sgl_cpu::replay: expected the contiguous int64 [n, ", 1 + SGL_OP_ARGS,
                    "] tensor of record_end");
  return sgl_replay(reinterpret_cast<const sgl_op*>(ops.data_ptr<int64_t>()), ops.size(0));
}

// Each part's result as replay's (0, or 1 + the index of the call that failed).
std::vector<int64_t> replay_parts(at::TensorList parts) {
  std::vector<const sgl_op*> ops;
  std::vector<int64_t> counts, failed(parts.size());
  for (const Tensor& calls : parts) {
    TORCH_CHECK_VALUE(calls.device().is_cpu() && calls.scalar_type() == at::kLong &&
                          calls.dim() == 2 && calls.size(1) == 1 + SGL_OP_ARGS &&
                          calls.is_contiguous(),
                      "sgl_cpu::replay_parts: expected contiguous int64 [n, ", 1 + SGL_OP_ARGS,
                      "] tensors of record_end");
    ops.push_back(reinterpret_cast<const sgl_op*>(calls.data_ptr<int64_t>()));
    counts.push_back(calls.size(0));
  }
  sgl_replay_parts(ops.data(), counts.data(), static_cast<int64_t>(ops.size()), failed.data());
  return failed;
}

// --- building one call -----------------------------------------------------------------------

int64_t ptr(const Tensor& t) { return reinterpret_cast<intptr_t>(t.data_ptr()); }
int64_t ptr(const OptTensor& t) { return t.has_value() ? ptr(*t) : 0; }

int64_t bits(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof u);
  return u;
}

struct Call {
  sgl_op op{};
  int n = 0;
  explicit Call(int64_t kind) { op.kind = kind; }
  Call& operator<<(int64_t value) {
    op.a[n++] = value;
    return *this;
  }
};

// Runs the call (and keeps it while recording); the kernel's return code.
int run(const Call& call, std::initializer_list<const OptTensor> inputs,
        std::initializer_list<const Tensor> outputs) {
  const int rc = sgl_run_op(&call.op);
  if (tape.on) {
    tape.ops.push_back(call.op);
    for (const auto& t : inputs)
      if (t.has_value()) tape.inputs.push_back(*t);
    for (const auto& t : outputs) tape.outputs.push_back(t);
  }
  return rc;
}

int dtype_code(const Tensor& t) { return t.scalar_type() == at::kBFloat16 ? 1 : 0; }

// A 2-D CPU tensor of `dtype` (float32 or bfloat16 where `dtype` is undefined) with unit stride
// in its rows.
void check_rows(const char* op, const char* name, const Tensor& t,
                std::optional<at::ScalarType> dtype = std::nullopt) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU");
  TORCH_CHECK_VALUE(t.dim() == 2 && t.stride(1) == 1, op, ": ", name,
                    " must be 2-D with unit stride in its last dimension, got sizes ", t.sizes(),
                    " strides ", t.strides());
  if (dtype.has_value()) {
    TORCH_CHECK_VALUE(t.scalar_type() == *dtype, op, ": ", name, " must be ", *dtype, ", got ",
                      t.scalar_type());
  } else {
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op,
                      ": ", name, " must be float32 or bfloat16, got ", t.scalar_type());
  }
}

void check_contiguous(const char* op, const char* name, const Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), op,
                    ": ", name, " must be a contiguous CPU ", dtype, " tensor");
}

// The paged KV pools of an attention operator: contiguous CPU tensors of the queries' dtype.
void check_pools(const char* op, const Tensor& k_pool, const Tensor& v_pool,
                 at::ScalarType dtype) {
  TORCH_CHECK_VALUE(k_pool.device().is_cpu() && k_pool.scalar_type() == dtype &&
                        k_pool.is_contiguous() && v_pool.device().is_cpu() &&
                        v_pool.scalar_type() == dtype && v_pool.is_contiguous(),
                    op, ": the pools must be contiguous CPU tensors of q's dtype");
}

// req_to_token: a 2-D int64 CPU tensor with unit stride in its rows.
void check_table(const char* op, const Tensor& table) {
  TORCH_CHECK_VALUE(table.device().is_cpu() && table.scalar_type() == at::kLong &&
                        table.dim() == 2 && table.stride(1) == 1,
                    op, ": table must be a 2-D int64 CPU tensor with unit stride in its rows");
}

// --- the operators ---------------------------------------------------------------------------

Tensor linear(const char* op, const Tensor& x, const Tensor& packed, int64_t n,
              const OptTensor& bias, at::ScalarType dtype) {
  check_rows(op, "x", x, dtype);
  check_contiguous(op, "packed", packed, dtype);
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t k_padded = dtype == at::kBFloat16 ? (k + 31) / 32 * 32 : k;
  TORCH_CHECK_VALUE(n > 0 && packed.numel() == (n + 31) / 32 * 32 * k_padded, op,
                    ": packed holds ", packed.numel(), " values, not the packed [", n, ", ", k,
                    "] weight");
  if (bias.has_value()) {
    check_contiguous(op, "bias", *bias, at::kFloat);
    TORCH_CHECK_VALUE(bias->numel() == n, op, ": bias has ", bias->numel(), " values, not ", n);
  }
  Tensor y = new_output({m, n}, x.options());
  Call call(dtype == at::kFloat ? at_level(SGL_OP_LINEAR_F32, SGL_OP_LINEAR_F32_AVX2)
            : g_level == AMX    ? SGL_OP_LINEAR_BF16_AMX
            : g_level == AVX2   ? SGL_OP_LINEAR_BF16_AVX2
                                : SGL_OP_LINEAR_BF16_AVX512);
  call << ptr(x) << x.stride(0) << ptr(packed) << ptr(y) << n << m << n << k << ptr(bias);
  if (call.op.kind == SGL_OP_LINEAR_BF16_AVX512) call << (g_bf16_dot_matmul ? 1 : 0);
  TORCH_CHECK(run(call, {x, packed, bias}, {y}) == 0, op, ": no memory for the input's copy");
  return y;
}

Tensor linear_bf16(const Tensor& x, const Tensor& packed, int64_t n, const OptTensor& bias) {
  return linear("sgl::linear_bf16", x, packed, n, bias, at::kBFloat16);
}

Tensor linear_f32(const Tensor& x, const Tensor& packed, int64_t n, const OptTensor& bias) {
  return linear("sgl::linear_f32", x, packed, n, bias, at::kFloat);
}

// The quantized matmuls (layouts in sgl/kernels/quant.py): AVX-512 at its levels (for the decode
// shapes; it hands more rows to the AVX2 kernel itself), AVX2 at avx2.
Tensor linear_quant(const char* op, const Tensor& x, const Tensor& qweight, const Tensor& scales,
                    const OptTensor& bias, int bits, bool round_x) {
  check_rows(op, "x", x);
  const at::ScalarType qtype = bits == 4 ? at::kByte : at::kChar;
  check_contiguous(op, "qweight", qweight, qtype);
  check_contiguous(op, "scales", scales, at::kHalf);
  const int64_t block_bytes = bits == 4 ? 16 : 32;
  TORCH_CHECK_VALUE(qweight.dim() == 3 && qweight.size(2) == block_bytes, op,
                    ": qweight must be [N, K/32, ", block_bytes, "], got ", qweight.sizes());
  const int64_t m = x.size(0), n = qweight.size(0), k = qweight.size(1) * 32;
  TORCH_CHECK_VALUE(scales.dim() == 3 && scales.size(0) == n && scales.size(1) == k / 32 &&
                        scales.size(2) == 2,
                    op, ": scales must be [N, K/32, 2] = [", n, ", ", k / 32, ", 2], got ",
                    scales.sizes());
  TORCH_CHECK_VALUE(x.size(1) == k, op, ": x has ", x.size(1), " columns, the weight ", k);
  if (bias.has_value()) {
    check_contiguous(op, "bias", *bias, at::kFloat);
    TORCH_CHECK_VALUE(bias->numel() == n, op, ": bias has ", bias->numel(), " values, not ", n);
  }
  Tensor y = new_output({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  Call call(at_level(SGL_OP_LINEAR_QUANT_AVX512, SGL_OP_LINEAR_QUANT_AVX2));
  // the AVX-512 kernel's last argument: bit 0, the level has AVX512-BF16 (vdpbf16ps for
  // bfloat16 rows); bit 1, AMX (int8 tiles for round_x)
  call << ptr(x) << x.stride(0) << ptr(qweight) << ptr(scales) << ptr(y) << n << m << n << k
       << ptr(bias) << dtype_code(x) << bits << (round_x ? 1 : 0)
       << (g_level == AMX ? 3 : g_level == AVX512_BF16 ? 1 : 0);
  TORCH_CHECK(run(call, {x, qweight, scales, bias}, {y}) == 0, op,
              ": no memory for its buffers (the input's copy, a widened panel)");
  return y;
}

Tensor linear_q4(const Tensor& x, const Tensor& qweight, const Tensor& scales,
                 const OptTensor& bias, bool round_x) {
  return linear_quant("sgl::linear_q4", x, qweight, scales, bias, 4, round_x);
}

Tensor linear_q8(const Tensor& x, const Tensor& qweight, const Tensor& scales,
                 const OptTensor& bias, bool round_x) {
  return linear_quant("sgl::linear_q8", x, qweight, scales, bias, 8, round_x);
}

// The round_x matmul of a q4 or q8 weight packed in the x16 layout (sgl/kernels/quant.py:
// pack_x16): the AVX-512 kernel, at the levels where the CPU has AVX512-VNNI (the library packs
// weights only there).
Tensor linear_qx16(const Tensor& x, const Tensor& packed, int64_t bits, const OptTensor& bias) {
  const char* op = "sgl::linear_qx16";
  check_rows(op, "x", x);
  TORCH_CHECK_VALUE(bits == 4 || bits == 6 || bits == 8, op, ": bits must be 4, 6 or 8, got ",
                    bits);
  check_contiguous(op, "packed", packed, at::kByte);
  const int64_t block_bytes = bits == 4 ? 320 : bits == 6 ? 448 : 576;
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(2) == block_bytes, op,
                    ": packed must be uint8 [N/16, K/32, ", block_bytes, "], got ",
                    packed.sizes());
  const int64_t m = x.size(0), n = packed.size(0) * 16, k = packed.size(1) * 32;
  TORCH_CHECK_VALUE(x.size(1) == k, op, ": x has ", x.size(1), " columns, the weight ", k);
  if (bias.has_value()) {
    check_contiguous(op, "bias", *bias, at::kFloat);
    TORCH_CHECK_VALUE(bias->numel() == n, op, ": bias has ", bias->numel(), " values, not ", n);
  }
  TORCH_CHECK_VALUE(g_level != AVX2, op, ": the x16 layout has no kernel at the avx2 level");
  Tensor y = new_output({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  Call call(SGL_OP_LINEAR_QUANT_AVX512);
  // the level's bits as linear_quant's, and bit 2: the x16 layout
  call << ptr(x) << x.stride(0) << ptr(packed) << 0 << ptr(y) << n << m << n << k << ptr(bias)
       << dtype_code(x) << bits << 1
       << (4 | (g_level == AMX ? 3 : g_level == AVX512_BF16 ? 1 : 0));
  const int rc = run(call, {x, packed, bias}, {y});
  TORCH_CHECK_VALUE(rc != -2, op, ": this CPU has no AVX512-VNNI for the x16 layout");
  TORCH_CHECK(rc == 0, op, ": no memory for its buffers (the input's rounded copy)");
  return y;
}

// The int8 matmul (sgl/kernels/ops.py: linear_w8a8): the packed weight of pack_int8_weight,
// scales float32 [N]; AVX2 at avx2 (and where the CPU lacks AVX512-VNNI: the AVX-512 kernel hands
// over), AMX tiles at amx.
Tensor linear_w8a8(const Tensor& x, const Tensor& packed, const Tensor& scales,
                   const OptTensor& bias) {
  const char* op = "sgl::linear_w8a8";
  check_rows(op, "x", x);
  check_contiguous(op, "packed", packed, at::kByte);
  check_contiguous(op, "scales", scales, at::kFloat);
  const int64_t m = x.size(0), k = x.size(1), n = scales.numel();
  const int64_t kp = (k + 63) / 64 * 64, np = (n + 15) / 16 * 16;
  TORCH_CHECK_VALUE(k >= 1 && k <= 65536, op, ": x must have 1 to 65536 columns, got ", k);
  TORCH_CHECK_VALUE(n >= 1 && packed.dim() == 3 && packed.size(0) == np / 16 &&
                        packed.size(1) == kp / 4 && packed.size(2) == 64,
                    op, ": packed must be the [", np / 16, ", ", kp / 4,
                    ", 64] packing of a weight with ", n, " rows (scales) and ", k,
                    " columns (x), got ", packed.sizes());
  if (bias.has_value()) {
    check_contiguous(op, "bias", *bias, at::kFloat);
    TORCH_CHECK_VALUE(bias->numel() == n, op, ": bias has ", bias->numel(), " values, not ", n);
  }
  Tensor y = new_output({m, n}, x.options());
  if (m == 0) return y;
  Call call(at_level(SGL_OP_LINEAR_W8A8_AVX512, SGL_OP_LINEAR_W8A8_AVX2));
  call << ptr(x) << x.stride(0) << ptr(packed) << ptr(scales) << ptr(y) << n << m << n << k
       << ptr(bias) << dtype_code(x);
  if (call.op.kind == SGL_OP_LINEAR_W8A8_AVX512) call << (g_level == AMX ? 1 : 0);
  TORCH_CHECK(run(call, {x, packed, scales, bias}, {y}) == 0, op,
              ": no memory for x's rounded rows");
  return y;
}

void check_rmsnorm(const char* op, int rc) {
  TORCH_CHECK(rc != -2, op, ": no memory for its row buffer");
  TORCH_CHECK_VALUE(rc == 0, op, " refused its arguments (", rc, ")");
}

void check_norm_weight(const char* op, const Tensor& x, const Tensor& weight, int64_t width) {
  check_rows(op, "weight", weight, x.scalar_type());
  TORCH_CHECK_VALUE(weight.size(0) == 1 && weight.size(1) == width, op, ": weight must be [1, ",
                    width, "], got ", weight.sizes());
}

Tensor rmsnorm(const Tensor& x, const Tensor& weight, double eps) {
  const char* op = "sgl::rmsnorm";
  check_rows(op, "x", x);
  check_norm_weight(op, x, weight, x.size(1));
  const int64_t t = x.size(0), h = x.size(1);
  Tensor out = new_output({t, h}, x.options());
  Call call(at_level(SGL_OP_RMSNORM, SGL_OP_RMSNORM_AVX2));
  call << ptr(x) << x.stride(0) << 0 << 0 << 0 << h << ptr(weight) << ptr(out) << h << t << h
       << 1 << bits(static_cast<float>(eps)) << dtype_code(x);
  check_rmsnorm(op, run(call, {x, weight}, {out}));
  return out;
}

std::tuple<Tensor, Tensor> add_rmsnorm(const Tensor& x, const Tensor& residual,
                                       const Tensor& weight, double eps) {
  const char* op = "sgl::add_rmsnorm";
  check_rows(op, "x", x);
  check_rows(op, "residual", residual, x.scalar_type());
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), op, ": residual ", residual.sizes(),
                    " and x ", x.sizes(), " differ");
  check_norm_weight(op, x, weight, x.size(1));
  const int64_t t = x.size(0), h = x.size(1);
  Tensor out = new_output({t, h}, x.options());
  Tensor summed = new_output({t, h}, x.options());
  Call call(at_level(SGL_OP_RMSNORM, SGL_OP_RMSNORM_AVX2));
  call << ptr(x) << x.stride(0) << ptr(residual) << residual.stride(0) << ptr(summed) << h
       << ptr(weight) << ptr(out) << h << t << h << 1 << bits(static_cast<float>(eps))
       << dtype_code(x);
  check_rmsnorm(op, run(call, {x, residual, weight}, {out, summed}));
  return {out, summed};
}

Tensor rmsnorm_heads(const Tensor& x, const Tensor& weight, double eps, int64_t head_dim) {
  const char* op = "sgl::rmsnorm_heads";
  check_rows(op, "x", x);
  TORCH_CHECK_VALUE(head_dim > 0 && x.size(1) % head_dim == 0, op, ": rows of ", x.size(1),
                    " values are not whole heads of ", head_dim);
  check_norm_weight(op, x, weight, head_dim);
  const int64_t t = x.size(0), heads = x.size(1) / head_dim;
  Tensor out = new_output({t, x.size(1)}, x.options());
  Call call(at_level(SGL_OP_RMSNORM, SGL_OP_RMSNORM_AVX2));
  call << ptr(x) << x.stride(0) << 0 << 0 << 0 << 0 << ptr(weight) << ptr(out) << head_dim
       << t * heads << head_dim << heads << bits(static_cast<float>(eps)) << dtype_code(x);
  check_rmsnorm(op, run(call, {x, weight}, {out}));
  return out;
}

Tensor silu_mul(const Tensor& x) {
  const char* op = "sgl::silu_mul";
  check_rows(op, "x", x);
  TORCH_CHECK_VALUE(x.size(1) % 2 == 0, op, ": x must have an even width, got ", x.size(1));
  const int64_t t = x.size(0), d = x.size(1) / 2;
  Tensor out = new_output({t, d}, x.options());
  Call call(at_level(SGL_OP_SILU_MUL, SGL_OP_SILU_MUL_AVX2));
  call << ptr(x) << x.stride(0) << ptr(out) << d << t << d << dtype_code(x);
  run(call, {x}, {out});
  return out;
}

Tensor rotary(const Tensor& x, int64_t heads, int64_t head_dim, int64_t rotary_dim,
              const Tensor& cos_sin, const OptTensor& positions) {
  const char* op = "sgl::rotary";
  check_rows(op, "x", x);
  check_rows(op, "cos_sin", cos_sin, x.scalar_type());
  TORCH_CHECK_VALUE(heads > 0 && head_dim > 0 && x.size(1) >= heads * head_dim, op, ": x rows of ",
                    x.size(1), " values hold no ", heads, " heads of ", head_dim);
  TORCH_CHECK_VALUE(cos_sin.size(1) >= 2 * rotary_dim, op, ": cos_sin rows must hold ",
                    2 * rotary_dim, " values");
  const int64_t t = x.size(0);
  if (positions.has_value()) {
    check_contiguous(op, "positions", *positions, at::kLong);
    TORCH_CHECK_VALUE(positions->numel() == t, op, ": ", positions->numel(), " positions for ",
                      t, " tokens");
  } else {
    TORCH_CHECK_INDEX(t <= cos_sin.size(0), op, ": ", t, " tokens but ", cos_sin.size(0),
                      " rows in the rotary table");
  }
  Tensor out = new_output({t, heads * head_dim}, x.options());
  Call call(at_level(SGL_OP_ROTARY, SGL_OP_ROTARY_AVX2));
  call << ptr(x) << x.stride(0) << ptr(cos_sin) << cos_sin.stride(0) << ptr(positions)
       << cos_sin.size(0) << ptr(out) << t << heads << head_dim << rotary_dim << dtype_code(x);
  const int rc = run(call, {x, cos_sin, positions}, {out});
  TORCH_CHECK_INDEX(rc != -2, op, ": a position outside the ", cos_sin.size(0),
                    " rows of the rotary table");
  TORCH_CHECK_VALUE(rc == 0, op, ": rotary_dim ", rotary_dim, " for head_dim ", head_dim);
  return out;
}

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  const char* op = "sgl::embedding";
  TORCH_CHECK_VALUE(weight.device().is_cpu() && weight.dim() == 2 && weight.stride(1) == 1, op,
                    ": weight must be a 2-D CPU tensor with unit stride in its rows");
  check_contiguous(op, "ids", ids, at::kLong);
  const int64_t t = ids.numel(), h = weight.size(1);
  Tensor out = new_output({t, h}, weight.options());
  Call call(SGL_OP_EMBEDDING);
  call << ptr(weight) << weight.stride(0) << weight.size(0) << ptr(ids) << t << ptr(out) << h
       << h << weight.element_size();
  TORCH_CHECK_INDEX(run(call, {weight, ids}, {out}) == 0, op,
                    ": token id outside the embedding table of ", weight.size(0), " rows");
  return out;
}

// The rows `ids` of a quantized table (layouts in sgl/kernels/quant.py, told by qweight's dtype),
// dequantized into `dtype`: the AVX2 kernel of the quantized matmuls' file, at every level.
Tensor embedding_q(const Tensor& qweight, const Tensor& scales, const Tensor& ids,
                   at::ScalarType dtype) {
  const char* op = "sgl::embedding_q";
  const bool three_d = qweight.dim() == 3;
  const bool bytes = three_d && qweight.scalar_type() == at::kByte;
  // the x16 layouts (sgl/kernels/quant.py) come with an empty scales tensor
  const bool x16 = bytes && scales.numel() == 0 &&
                   (qweight.size(2) == 320 || qweight.size(2) == 576 || qweight.size(2) == 448);
  const bool q6 = x16 && qweight.size(2) == 448;  // only packed: a plain q6 table has no kernel
  const bool q4 = bytes && (qweight.size(2) == 16 || (x16 && qweight.size(2) == 320));
  const bool q8 = three_d && ((qweight.scalar_type() == at::kChar && qweight.size(2) == 32) ||
                              (x16 && qweight.size(2) == 576));
  TORCH_CHECK_VALUE(qweight.device().is_cpu() && qweight.is_contiguous() && (q4 || q8 || q6), op,
                    ": qweight must be a contiguous CPU uint8 [N, K/32, 16] (q4) or int8 "
                    "[N, K/32, 32] (q8) tensor, or uint8 [N/16, K/32, 320, 576 or 448] (q4x16, "
                    "q8x16, q6x16, with empty scales), got ", qweight.scalar_type(), " ",
                    qweight.sizes());
  const int64_t n = qweight.size(0) * (x16 ? 16 : 1), blocks = qweight.size(1), k = blocks * 32;
  if (!x16) {
    check_contiguous(op, "scales", scales, at::kHalf);
    TORCH_CHECK_VALUE(scales.dim() == 3 && scales.size(0) == n && scales.size(1) == blocks &&
                          scales.size(2) == 2,
                      op, ": scales must be float16 [N, K/32, 2] = [", n, ", ", blocks,
                      ", 2], got ", scales.sizes());
  }
  TORCH_CHECK_VALUE(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 &&
                        ids.is_contiguous(),
                    op, ": ids must be a 1-D int64 tensor (contiguous, on the CPU), got ",
                    ids.scalar_type(), " ", ids.sizes());
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16, op,
                    ": dtype must be float32 or bfloat16, got ", dtype);
  const int64_t t = ids.numel();
  Tensor out = new_output({t, k}, qweight.options().dtype(dtype));
  Call call(SGL_OP_EMBEDDING_QUANT);
  call << ptr(qweight) << ptr(scales) << n << k << ptr(ids) << t << ptr(out) << k
       << (dtype == at::kBFloat16 ? 1 : 0) << (q4 ? 4 : q6 ? 6 : 8) << (x16 ? 1 : 0);
  TORCH_CHECK_INDEX(run(call, {qweight, scales, ids}, {out}) == 0, op,
                    ": token id outside the embedding table of ", n, " rows");
  return out;
}

Tensor argmax(const Tensor& logits) {
  const char* op = "sgl::argmax";
  check_rows(op, "logits", logits, at::kFloat);
  TORCH_CHECK_VALUE(logits.size(1) > 0, op, ": empty rows");
  const int64_t b = logits.size(0), v = logits.size(1);
  Tensor out = new_output({b}, logits.options().dtype(at::kLong));
  Call call(at_level(SGL_OP_ARGMAX_F32, SGL_OP_ARGMAX_F32_AVX2));
  call << ptr(logits) << logits.stride(0) << b << v << ptr(out);
  run(call, {logits}, {out});
  return out;
}

Tensor decode_attention(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& k_pool,
                        Tensor& v_pool, const Tensor& table, const Tensor& rows,
                        const Tensor& lens, const Tensor& loc, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, double scale, double softcap,
                        int64_t window) {
  const char* op = "sgl::decode_attention";
  check_rows(op, "q", q);
  const auto dtype = q.scalar_type();
  check_rows(op, "k", k, dtype);
  check_rows(op, "v", v, dtype);
  check_pools(op, k_pool, v_pool, dtype);
  const int64_t tokens = q.size(0);
  const int64_t v_dim = v_pool.size(-1);
  TORCH_CHECK_VALUE(q.size(1) >= num_heads * head_dim && k.size(1) == num_kv_heads * head_dim &&
                        v.size(1) == num_kv_heads * v_dim && k.size(0) == tokens &&
                        v.size(0) == tokens,
                    op, ": q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " for ",
                    num_heads, " heads and ", num_kv_heads, " KV heads of ", head_dim);
  check_table(op, table);
  check_contiguous(op, "rows", rows, at::kLong);
  check_contiguous(op, "lens", lens, at::kLong);
  check_contiguous(op, "loc", loc, at::kLong);
  TORCH_CHECK_VALUE(rows.numel() == tokens && lens.numel() == tokens && loc.numel() == tokens, op,
                    ": rows, lens and loc must hold one value per token");
  Tensor out = new_output({tokens, num_heads * v_dim}, q.options());
  Call call(at_level(SGL_OP_DECODE_ATTENTION, SGL_OP_DECODE_ATTENTION_AVX2));
  call << ptr(q) << q.stride(0) << head_dim << ptr(k) << k.stride(0) << ptr(v) << v.stride(0)
       << ptr(k_pool) << ptr(v_pool) << ptr(table) << table.stride(0) << ptr(rows) << ptr(lens)
       << ptr(loc) << ptr(out) << out.stride(0) << tokens << num_heads << num_kv_heads << head_dim
       << v_dim << bits(static_cast<float>(scale)) << bits(static_cast<float>(softcap)) << window
       << dtype_code(q) << (g_level == AMX || g_level == AVX512_BF16 ? 1 : 0);
  const int rc = run(call, {q, k, v, k_pool, v_pool, table, rows, lens, loc}, {out});
  TORCH_CHECK(rc != -2, op, ": no memory for the scores");
  TORCH_CHECK_VALUE(rc == 0, op, ": ", num_heads, " heads and ", num_kv_heads, " KV heads of ",
                    head_dim, " (values ", v_dim, ") are not a shape the kernel takes");
  return out;
}

Tensor extend_attention(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                        const Tensor& table, const Tensor& rows, const Tensor& q_starts,
                        const Tensor& prefix_lens, const Tensor& extend_lens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, double scale, double softcap,
                        int64_t window, const OptTensor& tree_bits) {
  const char* op = "sgl::extend_attention";
  check_rows(op, "q", q);
  const auto dtype = q.scalar_type();
  check_pools(op, k_pool, v_pool, dtype);
  TORCH_CHECK_VALUE(q.size(1) >= num_heads * head_dim, op, ": q rows of ", q.size(1),
                    " values hold no ", num_heads, " heads of ", head_dim);
  check_table(op, table);
  for (const auto* t : {&rows, &q_starts, &prefix_lens, &extend_lens})
    check_contiguous(op, "rows, q_starts, prefix_lens and extend_lens", *t, at::kLong);
  const int64_t batch = rows.numel();
  TORCH_CHECK_VALUE(q_starts.numel() == batch && prefix_lens.numel() == batch &&
                        extend_lens.numel() == batch,
                    op, ": rows, q_starts, prefix_lens and extend_lens must have one value per "
                    "sequence");
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* prefix = prefix_lens.data_ptr<int64_t>();
  const int64_t* lens = extend_lens.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; b++) {
    TORCH_CHECK_INDEX(starts[b] >= 0 && lens[b] >= 0 && starts[b] + lens[b] <= q.size(0), op,
                      ": sequence ", b, "'s tokens lie outside q's ", q.size(0), " rows");
    TORCH_CHECK_INDEX(prefix[b] >= 0 && prefix[b] + lens[b] <= table.size(1) && row[b] >= 0 &&
                          row[b] < table.size(0),
                      op, ": sequence ", b, " lies outside the table");
  }
  if (tree_bits.has_value()) {
    check_contiguous(op, "tree_bits", *tree_bits, at::kInt);
    TORCH_CHECK_VALUE(tree_bits->numel() == q.size(0), op, ": tree_bits must have one value per "
                      "row of q, got ", tree_bits->numel(), " for ", q.size(0));
    const int32_t* seen = tree_bits->data_ptr<int32_t>();
    for (int64_t b = 0; b < batch; b++)  // a longer sequence must be plain causal (all bits)
      for (int64_t t = 0; lens[b] > 32 && t < lens[b]; t++)
        TORCH_CHECK_VALUE(seen[starts[b] + t] == -1, op, ": sequence ", b, " is a token tree of ",
                          lens[b], " new tokens; the kernel takes trees of at most 32");
  }
  const int64_t v_dim = v_pool.size(-1);
  Tensor out = at::zeros({q.size(0), num_heads * v_dim}, q.options());
  Call call(at_level(SGL_OP_EXTEND_ATTENTION, SGL_OP_EXTEND_ATTENTION_AVX2));
  call << ptr(q) << q.stride(0) << ptr(k_pool) << ptr(v_pool) << ptr(table) << table.stride(0)
       << ptr(rows) << ptr(q_starts) << ptr(prefix_lens) << ptr(extend_lens) << batch << ptr(out)
       << out.stride(0) << num_heads << num_kv_heads << head_dim << v_dim
       << bits(static_cast<float>(scale)) << bits(static_cast<float>(softcap)) << window
       << dtype_code(q) << (g_level == AMX || g_level == AVX512_BF16 ? 1 : 0) << ptr(tree_bits);
  const int rc = run(call, {q, k_pool, v_pool, table, rows, q_starts, prefix_lens, extend_lens,
                            tree_bits},
                     {out});
  TORCH_CHECK(rc != -2, op, ": no memory for its buffers");
  TORCH_CHECK_VALUE(rc == 0, op, ": ", num_heads, " heads and ", num_kv_heads, " KV heads of ",
                    head_dim, " (values ", v_dim, ") are not a shape the kernel takes");
  return out;
}

}  // namespace

TORCH_LIBRARY(sgl_cpu, m) {
  m.def("version() -> int", &version);
  m.def("set_level(str level, bool bf16_dot_matmul, bool emulated) -> ()", &set_level);
  m.def("emulation() -> bool", &emulation);
  m.def("level() -> str", &level);
  m.def("set_threads(int threads) -> int", &set_threads);
  m.def("record_begin(Tensor? arena=None) -> ()", &record_begin);
  m.def("record_end() -> (Tensor, Tensor[], Tensor[], int)", &record_end);
  m.def("replay(Tensor ops) -> int", &replay);
  m.def("replay_parts(Tensor[] parts) -> int[]", &replay_parts);
}

TORCH_LIBRARY_IMPL(sgl, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_q4", &linear_q4);
  m.impl("linear_q8", &linear_q8);
  m.impl("linear_qx16", &linear_qx16);
  m.impl("linear_w8a8", &linear_w8a8);
  m.impl("rmsnorm", &rmsnorm);
  m.impl("add_rmsnorm", &add_rmsnorm);
  m.impl("rmsnorm_heads", &rmsnorm_heads);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
  m.impl("embedding", &embedding);
  m.impl("embedding_q", &embedding_q);
  m.impl("argmax", &argmax);
  m.impl("decode_attention", &decode_attention);
  m.impl("extend_attention", &extend_attention);
}
