// The nccl transport: GPU ranks, one device each, stream-ordered.
//
// Each communicator holds two NCCL communicators over the same ranks, both non-blocking (no NCCL
// call ever blocks the host, so every wait can keep its deadline):
//   - `data`: messages in device memory, enqueued on the communicator's own comm stream. A call
//     forks the comm stream from stream() with an event, and its request's wait() joins it back:
//     no host synchronisation, and a CUDA graph can capture both. A non-blocking ncclGroupEnd
//     returns before NCCL's own thread has put the group's kernel on the comm stream; the call
//     does not wait for that (the kernels the caller launches next start at once), and the group
//     "lands" (its end is recorded on the comm stream) when its request is waited on or the next
//     call needs the channel, whichever comes first.
//   - `control`: messages in host memory (the strategies' agreement on their arguments, split,
//     barrier). They go through a device staging buffer and the host waits for them.
// A World (the communicators made by one init and their splits) shares a failure state and a
// watchdog thread. The watchdog polls every operation in flight against its deadline and every
// NCCL communicator for an asynchronous error; on either it aborts all of the world's NCCL
// communicators (the kernels waiting on a dead peer return) and records the error, which every
// later call, wait() and synchronize() throws as CommError. Under CUDA graph capture nothing can
// be polled: captured operations have no deadline. NCCL finalises a communicator only once every
// CUDA graph holding work of it is destroyed, so a world that has had work captured closes its
// NCCL communicators only if that happens within a short grace, and otherwise leaves them to the
// process's end (the graphs of a script often live until then); after a failure it aborts them on
// threads of their own, since an abort waits for those graphs too.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../../core/backends.h"
#include "../../core/check.h"
#include "../../kernels/cuda/check.h"
#include "ringflash/comm.h"
#include "ringflash/errors.h"

namespace ringflash {
namespace comm::nccl {

bool is_available() { return true; }

std::string describe() {
  int version = 0;
  ncclGetVersion(&version);
  return "compiled in (NCCL " + std::to_string(version) + ")";
}

}  // namespace comm::nccl

namespace {

using core::str_cat;
using Clock = std::chrono::steady_clock;

constexpr auto kPollInterval = std::chrono::microseconds(50);
constexpr auto kWatchdogInterval = std::chrono::milliseconds(10);
// How long a communicator whose world has had work captured into a CUDA graph waits for NCCL to
// finalise it when it is closed.
constexpr auto kCapturedCloseGrace = std::chrono::milliseconds(500);
constexpr auto kSynchronizeGrace = std::chrono::seconds(1);

double seconds(std::chrono::milliseconds t) { return std::chrono::duration<double>(t).count(); }

std::string nccl_error(ncclComm_t comm, ncclResult_t rc) {
  const char* detail = comm ? ncclGetLastError(comm) : nullptr;
  return str_cat(ncclGetErrorString(rc), detail && *detail ? str_cat(" (", detail, ")") : "");
}

// "rank 1", or "ranks (1, 3)": the peers of a set of messages.
std::string peers_of(const std::vector<P2POp>& ops, int me) {
  std::vector<int> peers;
  for (const P2POp& op : ops)
    if (op.peer != me && std::find(peers.begin(), peers.end(), op.peer) == peers.end()) peers.push_back(op.peer);
  std::sort(peers.begin(), peers.end());
  if (peers.empty()) return "this rank";
  if (peers.size() == 1) return str_cat("rank ", peers[0]);
  std::string s = "ranks (";
  for (size_t i = 0; i < peers.size(); ++i) s += str_cat(i ? ", " : "", peers[i]);
  return s + ")";
}

// ---- the world ----------------------------------------------------------------------------

// The failure state, the NCCL communicators to abort, and the operations in flight of one world.
class World {
 public:
  explicit World(int device) : device_(device), watchdog_([this] { watch(); }) {}
  ~World() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    watchdog_.join();
    for (Pending& p : pending_) cudaEventDestroy(p.done);
  }

  // Serialises NCCL calls with the watchdog's aborts.
  std::mutex& mutex() { return mutex_; }

  // The first failure, or "" while the world is healthy. Callers hold mutex().
  const std::string& failure() const { return failure_; }

  // Whether any of the world's work has been captured into a CUDA graph. Callers hold mutex().
  bool captured() const { return captured_; }
  void mark_captured() {
    std::lock_guard<std::mutex> lock(mutex_);
    captured_ = true;
  }
  void throw_if_failed() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.empty()) throw CommError(failure_);
  }

  // Aborts the NCCL communicator `c`. An abort first tells the communicator's kernels to quit,
  // then releases it, and the release waits until no CUDA graph holds the communicator's work: in
  // a world that has had work captured, the abort runs on a thread of its own, which a live graph
  // may keep until the process ends, so that the caller (holding mutex()) goes on at once.
  void abort_locked(ncclComm_t c) {
    if (!captured_) {
      ncclCommAbort(c);
      return;
    }
    std::thread([c, device = device_] {
      cudaSetDevice(device);
      ncclCommAbort(c);
    }).detach();
  }

  // Records `reason` (the first one wins) and aborts every NCCL communicator. Callers hold mutex().
  void fail_locked(const std::string& reason) {
    if (failure_.empty()) failure_ = reason;
    for (ncclComm_t& c : comms_) {
      if (c) abort_locked(c);
      c = nullptr;
    }
  }
  void fail(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    fail_locked(reason);
  }

  // The slot of an NCCL communicator (made on first use); it reads null once the world has
  // aborted or closed it.
  ncclComm_t* slot(ncclComm_t comm) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (ncclComm_t& c : comms_)
      if (c == comm) return &c;
    comms_.push_back(comm);
    return &comms_.back();
  }

  // Watches `done` (recorded on a comm stream) until it completes; `error` is the failure if it
  // has not by `deadline`.
  void watch(cudaEvent_t done, Clock::time_point deadline, std::string error) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back({done, deadline, std::move(error)});
  }

 private:
  struct Pending {
    cudaEvent_t done;
    Clock::time_point deadline;
    std::string error;
  };

  void watch() {
    cudaSetDevice(device_);
    // Relaxed: another thread's capture in global mode would otherwise forbid this thread's
    // cudaEventQuery (and invalidate that capture).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, kWatchdogInterval);
      if (!failure_.empty()) continue;
      const Clock::time_point now = Clock::now();
      for (auto it = pending_.begin(); it != pending_.end();) {
        const cudaError_t rc = cudaEventQuery(it->done);
        if (rc == cudaErrorNotReady && now < it->deadline) {
          ++it;
          continue;
        }
        if (rc == cudaErrorNotReady) fail_locked(it->error);
        cudaEventDestroy(it->done);
        it = pending_.erase(it);
      }
      for (ncclComm_t c : comms_) {
        ncclResult_t state = ncclSuccess;
        if (!c || ncclCommGetAsyncError(c, &state) != ncclSuccess) continue;
        if (state != ncclSuccess && state != ncclInProgress) {
          fail_locked(str_cat("[nccl] asynchronous error: ", nccl_error(c, state)));
          break;
        }
      }
    }
  }

  const int device_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  bool captured_ = false;
  std::string failure_;
  std::list<ncclComm_t> comms_;  // a list: slots stay where they are
  std::list<Pending> pending_;
  std::thread watchdog_;  // last: starts once the rest is built
};

// One non-blocking NCCL communicator of a world.
class Channel {
 public:
  Channel(std::shared_ptr<World> world, ncclComm_t comm) : world_(std::move(world)), slot_(world_->slot(comm)) {}

  ncclComm_t comm() const { return *slot_; }

  // Runs `issue` (NCCL calls on comm()) under the world's lock, then waits until NCCL has taken
  // them (non-blocking calls may return ncclInProgress) by `deadline`. Errors fail the world and
  // throw CommError: "<prefix><NCCL's words>", or "<prefix><timeout_error>" at the deadline.
  template <typename Issue>
  void run(const std::string& prefix, Clock::time_point deadline, const std::string& timeout_error, Issue&& issue) {
    this->issue(prefix, std::forward<Issue>(issue));
    settle(prefix, deadline, timeout_error);
  }

  // run() without the wait: the caller settles before comm() takes another call.
  template <typename Issue>
  void issue(const std::string& prefix, Issue&& issue) {
    std::lock_guard<std::mutex> lock(world_->mutex());
    if (!world_->failure().empty()) throw CommError(world_->failure());
    const ncclResult_t rc = issue(comm());
    if (rc != ncclSuccess && rc != ncclInProgress) fail_throw_locked(prefix + nccl_error(comm(), rc));
  }

  // Waits until comm() is no longer busy with a non-blocking call.
  void settle(const std::string& prefix, Clock::time_point deadline, const std::string& timeout_error) {
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(world_->mutex());
        if (!world_->failure().empty()) throw CommError(world_->failure());
        ncclResult_t state = ncclSuccess;
        const ncclResult_t rc = ncclCommGetAsyncError(comm(), &state);
        if (rc != ncclSuccess) fail_throw_locked(prefix + nccl_error(comm(), rc));
        if (state == ncclSuccess) return;
        if (state != ncclInProgress) fail_throw_locked(prefix + nccl_error(comm(), state));
        if (Clock::now() >= deadline) fail_throw_locked(prefix + timeout_error);
      }
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  // Releases the NCCL communicator: finalised and destroyed when healthy (aborted if that does
  // not finish by `deadline`), aborted after a failure. When the world has had work captured into
  // a CUDA graph, a finalisation that does not finish within kCapturedCloseGrace waits for a graph
  // that still holds that work; the communicator is then left to the process's end, since an
  // abort could wait on the same graph.
  void close(Clock::time_point deadline) noexcept {
    std::unique_lock<std::mutex> lock(world_->mutex());
    const ncclComm_t c = *slot_;
    if (!c) return;
    *slot_ = nullptr;
    ncclResult_t state = ncclInternalError;
    if (world_->failure().empty()) {
      const bool captured = world_->captured();
      if (captured) deadline = std::min(deadline, Clock::now() + kCapturedCloseGrace);
      state = ncclCommFinalize(c);
      while ((state == ncclSuccess || state == ncclInProgress) && Clock::now() < deadline) {
        if (ncclCommGetAsyncError(c, &state) != ncclSuccess || state != ncclInProgress) break;
        lock.unlock();
        std::this_thread::sleep_for(kPollInterval);
        lock.lock();
      }
      if (captured && state == ncclInProgress) return;
    }
    if (state == ncclSuccess) ncclCommDestroy(c);
    else world_->abort_locked(c);
  }

 private:
  [[noreturn]] void fail_throw_locked(const std::string& error) {
    world_->fail_locked(error);
    throw CommError(world_->failure());
  }

  std::shared_ptr<World> world_;
  ncclComm_t* slot_;
};

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// ---- the communicator ---------------------------------------------------------------------

bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  RINGFLASH_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// Device memory as CUDA reports it. Memory that a graph being captured allocates is not mapped yet
// (CUDA cannot tell), so callers take everything for device memory under capture, where host
// memory cannot be sent anyway.
bool is_device_memory(const void* p) {
  if (!p) return false;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error of an unknown pointer
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

// A request already complete when it is returned (host-memory messages).
class DoneRequest : public CommRequest {
 public:
  void wait() override {}
};

// A new event recorded on `stream` (the caller destroys it).
cudaEvent_t record(cudaStream_t stream) {
  cudaEvent_t e = nullptr;
  RINGFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  RINGFLASH_CUDA_CHECK(cudaEventRecord(e, stream));
  return e;
}

// A group posted on the data channel. land() waits until NCCL has enqueued it on the comm stream,
// then records `done` there and hands it to the watchdog (outside graph capture).
class Launch {
 public:
  Launch(std::shared_ptr<World> world, const Channel& channel, cudaStream_t comm_stream, std::string prefix,
         std::string late, Clock::time_point deadline, bool watched)
      : world_(std::move(world)), channel_(channel), comm_stream_(comm_stream), prefix_(std::move(prefix)),
        late_(std::move(late)), deadline_(deadline), watched_(watched) {}
  ~Launch() {
    if (done_) cudaEventDestroy(done_);
  }
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;

  cudaEvent_t done() const { return done_; }

  // Throws CommError if NCCL fails or has not taken the group by the deadline.
  void land() {
    if (landed_) return;
    landed_ = true;  // once: a failure here fails the world, and later calls throw that
    channel_.settle(prefix_, deadline_, late_);
    done_ = record(comm_stream_);
    if (watched_) world_->watch(record(comm_stream_), deadline_, late_);  // the watchdog destroys its own
  }

 private:
  std::shared_ptr<World> world_;
  Channel channel_;
  cudaStream_t comm_stream_;
  std::string prefix_, late_;
  Clock::time_point deadline_;
  bool watched_;
  bool landed_ = false;
  cudaEvent_t done_ = nullptr;
};

// Device-memory messages in flight: wait() makes the stream of the call wait for them.
class StreamRequest : public CommRequest {
 public:
  StreamRequest(std::shared_ptr<World> world, std::shared_ptr<Launch> launch, cudaStream_t stream, int device)
      : world_(std::move(world)), launch_(std::move(launch)), stream_(stream), device_(device) {}
  ~StreamRequest() override {
    if (!launch_) return;
    const cuda::QuietDeviceGuard guard(device_);
    try {
      launch_->land();
    } catch (...) {  // the world has failed; there is nothing to join
    }
    join();
  }
  void wait() override {
    if (!launch_) return world_->throw_if_failed();
    {
      cuda::DeviceGuard guard(device_);
      launch_->land();
      join();
    }
    world_->throw_if_failed();
  }

 private:
  void join() noexcept {
    if (launch_->done()) cudaStreamWaitEvent(stream_, launch_->done(), 0);
    launch_.reset();
  }

  std::shared_ptr<World> world_;
  std::shared_ptr<Launch> launch_;
  cudaStream_t stream_;
  int device_;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<World> world, ncclComm_t data, ncclComm_t control, int rank, int size, int device,
                   std::chrono::milliseconds timeout)
      : world_(std::move(world)), data_(world_, data), control_(world_, control), rank_(rank), size_(size),
        device_(device) {
    timeout_ = timeout;
    cuda::DeviceGuard guard(device_);
    // The comm stream has the highest priority: its kernels take the first SMs that the attention
    // kernels free, so transfers overlap compute instead of waiting for a whole kernel.
    int least = 0, greatest = 0;
    RINGFLASH_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    RINGFLASH_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_stream_, cudaStreamNonBlocking, greatest));
    RINGFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&control_stream_, cudaStreamNonBlocking));
  }

  ~NcclCommunicator() override {
    const cuda::QuietDeviceGuard guard(device_);
    try {
      land_posted();
    } catch (...) {  // the world has failed: close() aborts
    }
    const Clock::time_point deadline = Clock::now() + timeout_;
    control_.close(deadline);  // split from data_: closed first
    data_.close(deadline);
    if (staging_) cudaFree(staging_);
    cudaStreamDestroy(comm_stream_);
    cudaStreamDestroy(control_stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string transport() const override { return "nccl"; }
  bool stream_ordered() const override { return true; }

  std::unique_ptr<Communicator> split(int color, int key) override {
    const std::vector<int> members = split_members(color, key);
    const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    cuda::DeviceGuard guard(device_);
    const std::string prefix = this->prefix("split");
    const std::string late = str_cat("the other ranks did not split within ", seconds(timeout_), " s");
    const Clock::time_point deadline = Clock::now() + timeout_;
    ncclComm_t data = nullptr, control = nullptr;
    ncclConfig_t config = nonblocking_config();
    land_posted();
    data_.run(prefix, deadline, late, [&](ncclComm_t c) { return ncclCommSplit(c, color, key, &data, &config); });
    control_.run(prefix, deadline, late, [&](ncclComm_t c) { return ncclCommSplit(c, color, key, &control, &config); });
    auto child = std::make_unique<NcclCommunicator>(world_, data, control, new_rank,
                                                    static_cast<int>(members.size()), device_, timeout_);
    child->data_.settle(prefix, deadline, late);
    child->control_.settle(prefix, deadline, late);
    return child;
  }

  std::unique_ptr<CommRequest> send_recv(const std::vector<P2POp>& ops) override {
    check_ops("send_recv", ops);
    world_->throw_if_failed();
    cuda::DeviceGuard guard(device_);
    const bool capturing = is_capturing(static_cast<cudaStream_t>(stream_));
    bool device = false, host = false;
    for (const P2POp& op : ops) {
      if (op.bytes == 0) continue;
      (capturing || is_device_memory(op.data) ? device : host) = true;
    }
    RINGFLASH_CHECK(!(device && host), InvalidArgument, prefix("send_recv"),
                    "the buffers of one call must all be in device memory or all in host memory");
    count_sent(ops);
    if (host) {
      exchange_host("send_recv", ops);
      return std::make_unique<DoneRequest>();
    }
    return post("send_recv", ops);
  }

  // Device memory: every message, this rank's own part included, in one stream-ordered group.
  void all_to_all(const void* send, const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
                  void* recv, const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets) override {
    if (!in_device_memory(send, recv))
      return Communicator::all_to_all(send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets);
    constexpr const char* kOp = "all_to_all";
    for (const auto* v : {&send_bytes, &send_offsets, &recv_bytes, &recv_offsets})
      RINGFLASH_CHECK(v->size() == static_cast<size_t>(size_), InvalidArgument, prefix(kOp),
                      "every size and offset list must have one entry per rank (", size_, "), got ", v->size());
    std::vector<P2POp> ops;
    for (int j = 0; j < size_; ++j) {
      if (recv_bytes[j] > 0) ops.push_back(recv_op(j, static_cast<char*>(recv) + recv_offsets[j], recv_bytes[j]));
      if (send_bytes[j] > 0)
        ops.push_back(send_op(j, static_cast<const char*>(send) + send_offsets[j], send_bytes[j]));
    }
    blocking_device(kOp, ops);
  }

  void all_gather(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    if (!in_device_memory(send, recv)) return Communicator::all_gather(send, recv, bytes);
    constexpr const char* kOp = "all_gather";
    RINGFLASH_CHECK(bytes.size() == static_cast<size_t>(size_), InvalidArgument, prefix(kOp),
                    "bytes must have one entry per rank (", size_, "), got ", bytes.size());
    std::vector<P2POp> ops;
    size_t offset = 0;
    for (int j = 0; j < size_; ++j) {
      if (bytes[j] > 0) ops.push_back(recv_op(j, static_cast<char*>(recv) + offset, bytes[j]));
      if (bytes[rank_] > 0) ops.push_back(send_op(j, send, bytes[rank_]));
      offset += bytes[j];
    }
    blocking_device(kOp, ops);
  }

  void reduce_scatter(const float* send, float* recv, const std::vector<size_t>& counts) override {
    RINGFLASH_CHECK(!in_device_memory(send, recv), NotSupported, prefix("reduce_scatter"),
                    "the nccl transport sums host memory only");
    Communicator::reduce_scatter(send, recv, counts);
  }

  // One byte from every rank to every rank over the control channel.
  void barrier() override {
    std::vector<unsigned char> sent(static_cast<size_t>(size_), 1), received(static_cast<size_t>(size_));
    std::vector<P2POp> ops;
    for (int j = 0; j < size_; ++j) {
      if (j == rank_) continue;
      ops.push_back(recv_op(j, &received[j], 1));
      ops.push_back(send_op(j, &sent[j], 1));
    }
    cuda::DeviceGuard guard(device_);
    exchange_host("barrier", ops);
  }

  // Aborts the world's NCCL communicators: this rank's peers see it only by their deadlines.
  void fail(const std::string& reason) override { world_->fail(reason); }

  void synchronize() override {
    world_->throw_if_failed();
    cuda::DeviceGuard guard(device_);
    // A grace past the deadline: an operation late by its own deadline is the watchdog's to report,
    // with its op and peer.
    const Clock::time_point start = Clock::now(), deadline = start + timeout_ + kSynchronizeGrace;
    const std::string late =
        str_cat(prefix("synchronize"), "operations in flight did not complete within ", seconds(timeout_), " s");
    land_posted();
    for (cudaStream_t s : {comm_stream_, static_cast<cudaStream_t>(stream_)}) {
      cudaEvent_t done = record(s);
      const std::string error = poll(done, deadline, late);
      cudaEventDestroy(done);
      if (!error.empty()) {
        world_->fail(error);
        end_wait(start, "");
        world_->throw_if_failed();
      }
    }
    end_wait(start, "");
  }

 private:
  // Whether a collective's buffers are in device memory (all of them under graph capture).
  bool in_device_memory(const void* send, const void* recv) {
    cuda::DeviceGuard guard(device_);
    return is_capturing(static_cast<cudaStream_t>(stream_)) || is_device_memory(send) || is_device_memory(recv);
  }

  // Counts what `ops` send to other ranks in stats_.
  void count_sent(const std::vector<P2POp>& ops) {
    for (const P2POp& op : ops)
      if (op.kind == P2POp::Kind::kSend && op.peer != rank_) stats_.bytes_sent += op.bytes;
  }

  // "" once `done` completes, the world's failure if it fails first, `late` at the deadline.
  std::string poll(cudaEvent_t done, Clock::time_point deadline, const std::string& late) {
    for (;;) {
      const cudaError_t rc = cudaEventQuery(done);
      if (rc == cudaSuccess) return "";
      if (rc != cudaErrorNotReady)
        return str_cat("[cuda] ", cudaGetErrorName(rc), ": ", cudaGetErrorString(rc));
      {
        std::lock_guard<std::mutex> lock(world_->mutex());
        if (!world_->failure().empty()) return world_->failure();
      }
      if (Clock::now() >= deadline) return late;
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  static void enqueue(ncclComm_t comm, const std::vector<P2POp>& ops, cudaStream_t stream,
                      const std::vector<void*>* data = nullptr) {
    for (size_t i = 0; i < ops.size(); ++i) {
      const P2POp& op = ops[i];
      if (op.bytes == 0) continue;
      void* p = data ? (*data)[i] : op.data;
      if (op.kind == P2POp::Kind::kSend) ncclSend(p, op.bytes, ncclUint8, op.peer, comm, stream);
      else ncclRecv(p, op.bytes, ncclUint8, op.peer, comm, stream);
    }
  }

  std::string no_message(const char* op, const std::vector<P2POp>& ops) const {
    return str_cat(prefix(op), "no message from ", peers_of(ops, rank_), " within ", seconds(timeout_), " s");
  }

  // Device memory: forks the comm stream from stream(), posts the group on it, and returns the
  // request that joins it back, without waiting for the group to land. The watchdog holds the
  // deadline (none under graph capture).
  std::unique_ptr<CommRequest> post(const char* op, const std::vector<P2POp>& ops) {
    land_posted();
    const auto stream = static_cast<cudaStream_t>(stream_);
    cudaEvent_t ready = record(stream);
    RINGFLASH_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ready, 0));
    cudaEventDestroy(ready);
    const Clock::time_point deadline = Clock::now() + timeout_;
    const bool capturing = is_capturing(stream);
    if (capturing) world_->mark_captured();
    auto launch = std::make_shared<Launch>(world_, data_, comm_stream_, prefix(op), no_message(op, ops), deadline,
                                           !capturing);
    data_.issue(prefix(op), [&](ncclComm_t c) {
      ncclGroupStart();
      enqueue(c, ops, comm_stream_);
      return ncclGroupEnd();
    });
    posted_ = launch;
    return std::make_unique<StreamRequest>(world_, std::move(launch), stream, device_);
  }

  // Lands the last group posted, if its request has not: the data channel takes no other call, and
  // the comm stream no other group, before it has.
  void land_posted() {
    if (const std::shared_ptr<Launch> launch = std::exchange(posted_, nullptr)) launch->land();
  }

  // A device-memory collective: posted and joined back into stream() at once.
  void blocking_device(const char* op, const std::vector<P2POp>& ops) {
    world_->throw_if_failed();
    count_sent(ops);
    cuda::DeviceGuard guard(device_);
    post(op, ops)->wait();
  }

  // Host memory, over the control channel through the staging buffer; the host waits.
  void exchange_host(const char* op, const std::vector<P2POp>& ops) {
    const Clock::time_point start = Clock::now(), deadline = start + timeout_;
    RINGFLASH_CHECK(!is_capturing(static_cast<cudaStream_t>(stream_)), InvalidArgument, prefix(op),
                    "messages in host memory cannot be sent while the stream is captured into a CUDA graph");
    size_t total = 0;
    std::vector<size_t> offsets;
    for (const P2POp& o : ops) {
      offsets.push_back(total);
      total += (o.bytes + 255) / 256 * 256;
    }
    if (total > staging_bytes_) {
      if (staging_) RINGFLASH_CUDA_CHECK(cudaFree(staging_));
      staging_ = nullptr;
      RINGFLASH_CUDA_CHECK(cudaMalloc(&staging_, total));
      staging_bytes_ = total;
    }
    std::vector<void*> data(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
      data[i] = static_cast<char*>(staging_) + offsets[i];
      if (ops[i].kind == P2POp::Kind::kSend && ops[i].bytes > 0)
        RINGFLASH_CUDA_CHECK(
            cudaMemcpyAsync(data[i], ops[i].data, ops[i].bytes, cudaMemcpyHostToDevice, control_stream_));
    }
    const std::string late = no_message(op, ops);
    control_.run(prefix(op), deadline, late, [&](ncclComm_t c) {
      ncclGroupStart();
      enqueue(c, ops, control_stream_, &data);
      return ncclGroupEnd();
    });
    // The copies back start once the messages are in: a copy into pageable memory blocks the host
    // until it is done, with no deadline.
    cudaEvent_t done = record(control_stream_);
    const std::string error = poll(done, deadline, late);
    cudaEventDestroy(done);
    if (!error.empty()) world_->fail(error);
    end_wait(start, "");
    world_->throw_if_failed();
    for (size_t i = 0; i < ops.size(); ++i)
      if (ops[i].kind == P2POp::Kind::kRecv && ops[i].bytes > 0)
        RINGFLASH_CUDA_CHECK(cudaMemcpy(ops[i].data, data[i], ops[i].bytes, cudaMemcpyDeviceToHost));
  }

  std::shared_ptr<World> world_;
  Channel data_, control_;
  const int rank_, size_, device_;
  cudaStream_t comm_stream_ = nullptr, control_stream_ = nullptr;
  std::shared_ptr<Launch> posted_;  // the last group posted on data_, until it lands
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
};

}  // namespace

NcclUniqueId nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t rc = ncclGetUniqueId(&id);
  RINGFLASH_CHECK(rc == ncclSuccess, CommError, "[nccl_unique_id] ", ncclGetErrorString(rc));
  NcclUniqueId out;
  static_assert(sizeof(out.bytes) == sizeof(id.internal), "NCCL's unique id has 128 bytes");
  std::memcpy(out.bytes, id.internal, sizeof(out.bytes));
  return out;
}

std::unique_ptr<Communicator> nccl_communicator(const NcclUniqueId& id, int rank, int size, int device,
                                                std::chrono::milliseconds timeout) {
  RINGFLASH_CHECK(size >= 1 && rank >= 0 && rank < size, InvalidArgument,
                  "[nccl_communicator] rank must be in [0, size) with size >= 1, got rank ", rank, " and size ", size);
  int devices = 0;
  RINGFLASH_CUDA_CHECK(cudaGetDeviceCount(&devices));
  RINGFLASH_CHECK(device >= 0 && device < devices, InvalidArgument, "[nccl_communicator] device must be in [0, ",
                  devices, "), got ", device);
  cuda::DeviceGuard guard(device);
  ncclUniqueId nid;
  std::memcpy(nid.internal, id.bytes, sizeof(id.bytes));
  auto world = std::make_shared<World>(device);
  const std::string prefix = str_cat("[nccl_communicator] rank ", rank, " of ", size, ": ");
  const std::string late = str_cat("not every rank joined within ", seconds(timeout), " s");
  const Clock::time_point deadline = Clock::now() + timeout;
  ncclConfig_t config = nonblocking_config();
  ncclComm_t data = nullptr, control = nullptr;
  {
    const ncclResult_t rc = ncclCommInitRankConfig(&data, size, nid, rank, &config);
    RINGFLASH_CHECK(rc == ncclSuccess || rc == ncclInProgress, CommError, prefix, nccl_error(data, rc));
  }
  Channel first(world, data);
  first.settle(prefix, deadline, late);
  first.run(prefix, deadline, late, [&](ncclComm_t c) { return ncclCommSplit(c, 0, rank, &control, &config); });
  Channel(world, control).settle(prefix, deadline, late);
  return std::make_unique<NcclCommunicator>(world, data, control, rank, size, device, timeout);
}

std::unique_ptr<Communicator> nccl_communicator(Communicator& bootstrap, int device) {
  NcclUniqueId id{};
  const int me = bootstrap.rank(), n = bootstrap.size();
  if (me == 0) id = nccl_unique_id();
  std::vector<P2POp> ops;
  if (me == 0) {
    for (int j = 1; j < n; ++j) ops.push_back(send_op(j, id.bytes, sizeof(id.bytes)));
  } else {
    ops.push_back(recv_op(0, id.bytes, sizeof(id.bytes)));
  }
  bootstrap.send_recv(ops)->wait();
  return nccl_communicator(id, me, n, device, bootstrap.timeout());
}

}  // namespace ringflash
