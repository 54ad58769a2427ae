// Model tools behind `tandem convert llama2c`, `tandem synth` and `tandem quantize`.
//
// Each function reads its inputs, builds a GGUF v3 file that both tandem and llama.cpp load,
// and writes it atomically (temp file + rename), streaming tensor data so memory stays small
// even for multi-GiB outputs. They are plain blocking calls with no shared state: safe to call
// from any thread, one output file per call. Errors are absl::Status: NOT_FOUND and friends for
// files (from errno), INVALID_ARGUMENT for malformed inputs or bad options.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tandem/kernels/dtype.h"

namespace tandem::tools {

// llama2.c checkpoint (legacy v0 header) + tokenizer.bin -> GGUF llama model, f32 weights,
// laid out as llama.cpp's own llama2.c converter does (output.weight always written).
struct ConvertLlama2cOptions {
  std::string model_path;
  std::string tokenizer_path;
  std::string out_path;
};
absl::Status ConvertLlama2c(const ConvertLlama2cOptions& options);

// Random weights of a named real shape (SynthShapeNames()), with a real tokenizer copied from
// <vocab_dir>/ggml-vocab-*.gguf. Deterministic: the same options give identical bytes.
// 2D matrices are stored as `type` (F16 for a matrix whose row length is not a multiple of
// the type's block); norms and biases stay F32.
struct SynthOptions {
  std::string shape;
  kernels::DType type = kernels::DType::kF32;
  std::string out_path;
  uint64_t seed = 0;
  std::string vocab_dir;
};
absl::Status Synthesize(const SynthOptions& options);
std::vector<std::string> SynthShapeNames();

// Copies a GGUF model, converting every 2D `.weight` matrix to `type` (via f32) and setting
// general.file_type. 1D tensors are left as they are.
absl::Status QuantizeModel(const std::string& in_path, const std::string& out_path,
                           kernels::DType type);

// llama_ftype number for a model whose matrices are `type` (general.file_type).
uint32_t FileTypeFor(kernels::DType type);

// Llama 3 rope scaling as per-frequency divisors (the rope_freqs.weight tensor), computed as
// llama.cpp's HF converter does: head_dim / 2 values, 1 for short wavelengths, `factor` for
// long ones and a smooth blend between.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_context = 8192;
};
std::vector<float> Llama3RopeFactors(const Llama3RopeScaling& scaling, double rope_base,
                                     int64_t head_dim);

}  // namespace tandem::tools
