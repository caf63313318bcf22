#include "runtime/block_graphs.h"

#include <ATen/ATen.h>

#include <sstream>

#include "common/log.h"

#ifdef EO_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace eo {

struct BlockGraphs::Entry {
  int uses = 0;
  std::vector<at::Tensor> in, out;  // the shared static buffers this graph reads and writes
#ifdef EO_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
};

#ifdef EO_WITH_CUDA
// One capture stream (graphs cannot be captured on the legacy default stream) and one memory pool
// for every graph. Each run() is ordered after the caller's stream and the caller's stream after it,
// so tensors crossing between the two streams need no further care.
struct BlockGraphs::Pool {
  explicit Pool(const at::Device& d)
      : stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, d.index())), id(at::cuda::graph_pool_handle()) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&to_side, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&to_caller, cudaEventDisableTiming));
  }
  ~Pool() {
    cudaEventDestroy(to_side);
    cudaEventDestroy(to_caller);
  }
  c10::cuda::CUDAStream stream;
  decltype(at::cuda::graph_pool_handle()) id;
  cudaEvent_t to_side = nullptr, to_caller = nullptr;  // reused: run() calls follow one another
};

namespace {
// For one run(): the capture stream waits for the caller's stream, becomes current, and on exit the
// caller's stream waits for it.
class OnCaptureStream {
 public:
  OnCaptureStream(BlockGraphs::Pool& pool, int device)
      : pool_(pool), caller_(c10::cuda::getCurrentCUDAStream(device)), guard_(pool.stream) {
    C10_CUDA_CHECK(cudaEventRecord(pool_.to_side, caller_.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(pool_.stream.stream(), pool_.to_side, 0));
  }
  ~OnCaptureStream() {
    // No throw from a destructor: an error here resurfaces at the next CUDA call.
    if (cudaEventRecord(pool_.to_caller, pool_.stream.stream()) == cudaSuccess)
      (void)cudaStreamWaitEvent(caller_.stream(), pool_.to_caller, 0);
  }

 private:
  BlockGraphs::Pool& pool_;
  c10::cuda::CUDAStream caller_;
  c10::cuda::CUDAStreamGuard guard_;
};
}  // namespace
#else
struct BlockGraphs::Pool {};
#endif

BlockGraphs::BlockGraphs(const at::Device& device, bool enabled) : device_(device), enabled_(enabled && device.is_cuda()) {
#ifdef EO_WITH_CUDA
  if (enabled_) pool_ = std::make_unique<Pool>(device_);
#else
  enabled_ = false;
#endif
}

BlockGraphs::~BlockGraphs() = default;

int BlockGraphs::graphs() const {
  int n = 0;
#ifdef EO_WITH_CUDA
  for (const auto& [k, e] : entries_) n += e->graph ? 1 : 0;
#endif
  return n;
}

at::Tensor& BlockGraphs::shared_buffer(std::map<std::string, at::Tensor>& buffers, std::size_t position, const at::Tensor& like) {
  std::ostringstream name;
  name << position << ':' << like.sizes() << ':' << like.scalar_type();
  at::Tensor& t = buffers[name.str()];
  if (!t.defined()) t = at::empty_like(like, at::MemoryFormat::Contiguous);
  return t;
}

std::vector<at::Tensor> BlockGraphs::run(const std::string& key, const std::vector<at::Tensor>& inputs, const Fn& fn) {
  if (!enabled_) return fn(inputs);
#ifdef EO_WITH_CUDA
  std::ostringstream full;
  full << key;
  for (const auto& t : inputs) {
    full << '|';
    if (t.defined()) full << t.sizes() << t.scalar_type();
  }
  std::unique_ptr<Entry>& slot = entries_[full.str()];
  if (!slot) slot = std::make_unique<Entry>();
  Entry& e = *slot;
  OnCaptureStream on(*pool_, device_.index());
  if (e.uses++ == 0) return fn(inputs);  // warm-up, eagerly on the capture stream
  if (!e.graph) {
    capture(e, inputs, fn);
    if (!enabled_) return fn(inputs);  // the capture failed: eager from now on
  } else {
    for (std::size_t j = 0; j < inputs.size(); ++j)
      if (inputs[j].defined() && !inputs[j].is_same(e.in[j])) e.in[j].copy_(inputs[j]);
  }
  e.graph->replay();
  ++replays_;
  std::vector<at::Tensor> out;
  out.reserve(e.out.size());
  for (const auto& t : e.out) out.push_back(t.defined() ? t.clone() : at::Tensor());
  return out;
#else
  (void)key;
  return fn(inputs);
#endif
}

void BlockGraphs::capture(Entry& e, const std::vector<at::Tensor>& inputs, const Fn& fn) {
#ifdef EO_WITH_CUDA
  e.in.assign(inputs.size(), at::Tensor());
  for (std::size_t j = 0; j < inputs.size(); ++j)
    if (inputs[j].defined()) {
      e.in[j] = shared_buffer(inputs_, j, inputs[j]);
      e.in[j].copy_(inputs[j]);
    }
  // The graph's temporaries come from its own pool: hand back what the eager uses left cached in
  // the default pool first, so the two never hold a block's working set each.
  c10::cuda::CUDACachingAllocator::emptyCache();
  e.graph = std::make_unique<at::cuda::CUDAGraph>();
  bool capturing = false;
  try {
    // Thread-local: other threads (the collectives' watchdog, the data loader) keep querying events.
    e.graph->capture_begin(pool_->id, cudaStreamCaptureModeThreadLocal);
    capturing = true;
    std::vector<at::Tensor> outs = fn(e.in);
    e.out.assign(outs.size(), at::Tensor());
    for (std::size_t j = 0; j < outs.size(); ++j)
      if (outs[j].defined()) {
        e.out[j] = shared_buffer(outputs_, j, outs[j]);
        e.out[j].copy_(outs[j]);
      }
    outs.clear();
    capturing = false;
    e.graph->capture_end();
  } catch (const std::exception& ex) {
    if (capturing) {
      try {
        e.graph->capture_end();
      } catch (const std::exception&) {
      }
    }
    (void)cudaGetLastError();  // the invalidated capture's sticky-free error
    e.graph.reset();
    e.out.clear();
    enabled_ = false;
    std::string why = ex.what();
    why = why.substr(0, why.find('\n'));
    log::warn("CUDA graphs off for the rest of the run: a block use could not be captured (" + why +
              "); the step runs its kernels one by one");
  }
#else
  (void)e;
  (void)inputs;
  (void)fn;
#endif
}

}  // namespace eo
