#include "services/common/kv_device.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/util/status_util.h"
#include "services/common/kv_layout.h"

#if defined(TANDEM_HAVE_CUDA)
#include "common/cuda/cuda_raii.h"
#include "tandem/cuda/kv_checksum.h"
#endif

namespace tandem::services {

#if defined(TANDEM_HAVE_CUDA)

namespace {

// The pool's device becomes this thread's current device.
absl::Status UsePoolDevice(const engine::KvCache& kv) {
  const cuda::PointerKind k = cuda::ClassifyPointer(kv.k_layer(0));  // the pool's first byte
  if (!k.device) {
    return absl::FailedPreconditionError("the KV pool is not device memory");
  }
  TANDEM_CUDA_RETURN_IF(cudaSetDevice(k.ordinal));
  return absl::OkStatus();
}

const uint8_t* PoolBase(const engine::KvCache& kv) {
  return kv.k_layer(0);  // layer 0's K region starts the pool
}

}  // namespace

absl::StatusOr<std::vector<uint64_t>> DeviceSequenceChecksums(const engine::KvCache& kv,
                                                              std::span<const int32_t> blocks,
                                                              int64_t num_tokens) {
  const int32_t bs = kv.block_size();
  const int64_t n = BlocksFor(num_tokens, bs);
  if (n > static_cast<int64_t>(blocks.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(num_tokens, " tokens need ", n, " blocks; the table has ", blocks.size()));
  }
  std::vector<uint64_t> out(n);
  if (n == 0) return out;
  TANDEM_RETURN_IF_ERROR(UsePoolDevice(kv));
  std::vector<int32_t> slots(n);
  for (int64_t i = 0; i < n; ++i) {
    slots[i] = static_cast<int32_t>(std::min<int64_t>(bs, num_tokens - i * bs));
  }
  // One device allocation holds the block ids, the slot counts and the results.
  const size_t ids_bytes = sizeof(int32_t) * n;
  const size_t out_at = (2 * ids_bytes + 7) / 8 * 8;
  TANDEM_ASSIGN_OR_RETURN(cuda::DeviceMemory scratch,
                          cuda::DeviceMemory::Create(out_at + sizeof(uint64_t) * n));
  cudaStream_t s = cudaStreamPerThread;
  TANDEM_CUDA_RETURN_IF(
      cudaMemcpyAsync(scratch.data(), blocks.data(), ids_bytes, cudaMemcpyHostToDevice, s));
  TANDEM_CUDA_RETURN_IF(cudaMemcpyAsync(scratch.data() + ids_bytes, slots.data(), ids_bytes,
                                        cudaMemcpyHostToDevice, s));
  kernels::KvChecksumParams p;
  p.pool = PoolBase(kv);
  p.layer_stride = 2 * kv.layer_bytes();
  p.kv_stride = kv.layer_bytes();
  p.num_layers = kv.options().num_layers;
  p.block_bytes = kv.block_bytes();
  p.slot_bytes = kv.slot_bytes();
  p.blocks = reinterpret_cast<const int32_t*>(scratch.data());
  p.num_slots = reinterpret_cast<const int32_t*>(scratch.data() + ids_bytes);
  p.count = static_cast<int32_t>(n);
  p.out = reinterpret_cast<uint64_t*>(scratch.data() + out_at);
  TANDEM_RETURN_IF_ERROR(kernels::cuda::KvBlockChecksums(p, s));
  TANDEM_CUDA_RETURN_IF(
      cudaMemcpyAsync(out.data(), p.out, sizeof(uint64_t) * n, cudaMemcpyDeviceToHost, s));
  TANDEM_CUDA_RETURN_IF(cudaStreamSynchronize(s));
  return out;
}

struct KvStaging::Impl {
  cuda::PinnedHostBuffer buffer;
  cuda::CudaStream stream;
};

absl::StatusOr<std::unique_ptr<KvStaging>> KvStaging::Create(uint64_t bytes) {
  TANDEM_RETURN_IF_ERROR(cuda::RequireDevice());
  auto impl = std::make_unique<Impl>();
  TANDEM_ASSIGN_OR_RETURN(impl->stream, cuda::CudaStream::Create());
  TANDEM_ASSIGN_OR_RETURN(impl->buffer, cuda::PinnedHostBuffer::Create(bytes));
  return std::unique_ptr<KvStaging>(new KvStaging(std::move(impl)));
}

absl::Status KvStaging::Reserve(uint64_t bytes) {
  if (bytes <= impl_->buffer.size()) return absl::OkStatus();
  impl_->buffer = cuda::PinnedHostBuffer();
  TANDEM_ASSIGN_OR_RETURN(impl_->buffer, cuda::PinnedHostBuffer::Create(bytes));
  return absl::OkStatus();
}

uint8_t* KvStaging::data() const { return impl_->buffer.data(); }
uint64_t KvStaging::size() const { return impl_->buffer.size(); }

absl::Status KvStaging::ToHost(const engine::KvCache& kv, std::span<const KvHostCopy> copies) {
  TANDEM_RETURN_IF_ERROR(UsePoolDevice(kv));
  for (const KvHostCopy& c : copies) {
    TANDEM_CUDA_RETURN_IF(cudaMemcpyAsync(c.host, PoolBase(kv) + c.pool_offset, c.length,
                                          cudaMemcpyDeviceToHost, impl_->stream.get()));
  }
  TANDEM_CUDA_RETURN_IF(cudaStreamSynchronize(impl_->stream.get()));
  return absl::OkStatus();
}

absl::Status KvStaging::FromHost(engine::KvCache& kv, std::span<const KvHostCopy> copies) {
  TANDEM_RETURN_IF_ERROR(UsePoolDevice(kv));
  for (const KvHostCopy& c : copies) {
    TANDEM_CUDA_RETURN_IF(cudaMemcpyAsync(kv.k_layer(0) + c.pool_offset, c.host, c.length,
                                          cudaMemcpyHostToDevice, impl_->stream.get()));
  }
  TANDEM_CUDA_RETURN_IF(cudaStreamSynchronize(impl_->stream.get()));
  return absl::OkStatus();
}

#else  // !TANDEM_HAVE_CUDA

namespace {
absl::Status NoCuda() {
  return absl::FailedPreconditionError(
      "device KV pool: this tandem was built without CUDA (nvcc was not found at configure "
      "time, or TANDEM_ENABLE_CUDA is OFF)");
}
}  // namespace

absl::StatusOr<std::vector<uint64_t>> DeviceSequenceChecksums(const engine::KvCache&,
                                                              std::span<const int32_t>, int64_t) {
  return NoCuda();
}

struct KvStaging::Impl {};
absl::StatusOr<std::unique_ptr<KvStaging>> KvStaging::Create(uint64_t) { return NoCuda(); }
absl::Status KvStaging::Reserve(uint64_t) { return NoCuda(); }
uint8_t* KvStaging::data() const { return nullptr; }
uint64_t KvStaging::size() const { return 0; }
absl::Status KvStaging::ToHost(const engine::KvCache&, std::span<const KvHostCopy>) {
  return NoCuda();
}
absl::Status KvStaging::FromHost(engine::KvCache&, std::span<const KvHostCopy>) { return NoCuda(); }

#endif

KvStaging::KvStaging(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvStaging::~KvStaging() = default;

}  // namespace tandem::services
