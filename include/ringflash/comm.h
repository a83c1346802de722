// Communicators: how ranks exchange bytes. The strategies (parallel.h) use only this interface.
//
// A Communicator is one rank's handle on a group of `size()` ranks. Every operation is
// collective over the ranks it names: all ranks of the communicator call the collectives (in the
// same order), and both ends call send_recv for each message.
//
// Buffers are host memory for the CPU transports (inproc, mpi). Sizes are in bytes unless the
// operation is typed. Send buffers are read, receive buffers written; a receive buffer may not
// overlap any buffer of the same call.
//
// Deadlines. Every wait ends by `timeout()` (default 5 minutes). When it passes, or a peer is
// known to have failed, the wait throws CommError naming the operation and the peer, e.g.
//   "[send_recv] rank 1 of 4: no message from rank 2 within 300 s".
//   "[all_to_all] rank 0 of 4: no message from rank 2, which failed: <its reason>".
// A rank whose call throws should let its communicator fail (fail(), or the transport's own
// detection) so that its peers end with a CommError too instead of waiting out the deadline. A
// wait that throws CommError has already failed its rank: the communicator, and every other one
// of the same world, is then unusable on that rank (its calls throw CommError).
//
// Threads. A rank's communicators are used by one thread at a time (MPI_THREAD_SERIALIZED). A
// CommRequest must complete or be destroyed before its communicator is destroyed.
//
// Transports:
//   inproc  (run_inproc) ranks are threads. A rank that fails, throws out of run_inproc's fn, or
//           returns from it is known to its peers at once: their waits on it fail without
//           waiting out the deadline.
//   nccl    (nccl_communicator) GPU ranks, stream-ordered; see there.
//   mpi     (mpi_world) ranks are processes. fail() and failed waits tell the peers at once, over
//           a control message. A process that returns early is seen only by the deadline, and
//           one that exits without MPI_Finalize (crash, exit()) makes mpiexec end the whole job.
// Both copy every send's payload when it is posted, so their send buffers are free at once;
// code that should also run on other transports does not rely on that.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ringflash {

// One message of a batched send_recv.
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind;
  int peer;       // rank in this communicator; may be this rank
  void* data;     // read for kSend, written for kRecv
  size_t bytes;   // must match the peer's op
};

// Messages between a pair of ranks are matched in the order they were posted, per direction.
inline P2POp send_op(int peer, const void* data, size_t bytes) {
  return {P2POp::Kind::kSend, peer, const_cast<void*>(data), bytes};
}
inline P2POp recv_op(int peer, void* data, size_t bytes) { return {P2POp::Kind::kRecv, peer, data, bytes}; }

// The operations of one send_recv, in flight. wait() completes them all (and throws CommError
// if any fails); the destructor waits too, swallowing errors, so buffers are never left in use.
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "inproc", "mpi", "nccl", or the name a binding gives.
  virtual std::string transport() const = 0;

  // Ranks that pass the same `color` (>= 0) form a new communicator, ordered by (key, rank), with
  // this communicator's timeout. Collective; its deadline is this communicator's. The new
  // communicator shares this one's failure state: a rank that fails on one fails on both.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // Posts every op (group semantics: no op waits for another of the same call) and returns at
  // once; the buffers stay in use until the request completes.
  virtual std::unique_ptr<CommRequest> send_recv(const std::vector<P2POp>& ops) = 0;

  // Rank i sends send_bytes[j] bytes from send + send_offsets[j] to rank j, and receives
  // recv_bytes[j] bytes from rank j at recv + recv_offsets[j] (uneven splits). Blocking.
  virtual void all_to_all(const void* send, const std::vector<size_t>& send_bytes,
                          const std::vector<size_t>& send_offsets, void* recv, const std::vector<size_t>& recv_bytes,
                          const std::vector<size_t>& recv_offsets);

  // recv = the concatenation of every rank's `send`, in rank order; rank j contributes
  // bytes[j] bytes (uneven sizes allowed). Blocking.
  virtual void all_gather(const void* send, void* recv, const std::vector<size_t>& bytes);

  // Sum over ranks of fp32 `send` (sum of counts elements), then rank j keeps elements
  // [offset_j, offset_j + counts[j]) of the sum in `recv`. Blocking. The sum runs in rank order,
  // so every run gives the same bits.
  virtual void reduce_scatter(const float* send, float* recv, const std::vector<size_t>& counts);

  virtual void barrier();

  // Marks this rank as failed on this communicator's world: peers waiting on it, on any
  // communicator split from the same world, fail with CommError at once, naming `reason`. For a
  // rank that will not take part any more (its own call threw). Never throws or waits.
  virtual void fail(const std::string& reason) = 0;

  // Stream order (GPU transports). A stream-ordered transport orders each operation after the work
  // enqueued on stream() (a cudaStream_t) before the call, and a request's wait() makes stream()
  // wait for the operation instead of blocking the host; synchronize() then blocks until all of
  // them are done, under the deadline. The CPU transports finish every operation in its wait()
  // and ignore the stream.
  virtual bool stream_ordered() const { return false; }
  void set_stream(void* stream) { stream_ = stream; }
  void* stream() const { return stream_; }
  virtual void synchronize() {}

  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  // What this rank has done on this communicator since it was made or last reset: payload bytes
  // it sent to other ranks (messages to itself not counted) and seconds spent inside waits
  // (CommRequest::wait and the blocking collectives). Collectives count what their messages
  // count: all_gather sends bytes[rank] to each other rank, reduce_scatter counts[j] floats to each
  // other rank j; split counts its exchange of (color, key).
  struct Stats {
    uint64_t bytes_sent = 0;
    double wait_seconds = 0.0;
  };
  Stats stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

 protected:
  // For the transports.

  // "[op] rank 1 of 4: ", the start of every message about this rank's call `op`.
  std::string prefix(const char* op) const;

  // Checks the ops of a send_recv-like call `op`: each one's kind, its peer (a rank of this
  // communicator) and its buffer (null only for 0 bytes). InvalidArgument otherwise.
  void check_ops(const char* op, const std::vector<P2POp>& ops) const;

  // split's exchange: every rank's (color, key), under the deadline (errors name split). Every rank
  // checks every color, so all of them throw the same InvalidArgument when one is negative.
  // Returns the ranks that passed `color`, ordered by (key, rank): the new communicator's members.
  std::vector<int> split_members(int color, int key);

  // Ends a wait that began at `start`: counts its time in stats_.wait_seconds, and if `error` is not
  // empty, fails this rank with it (its peers hear at once; see fail()) and throws CommError(error).
  void end_wait(std::chrono::steady_clock::time_point start, const std::string& error);

  std::chrono::milliseconds timeout_{std::chrono::minutes(5)};
  Stats stats_;  // kept up to date by the transports
  void* stream_ = nullptr;
};

// Runs fn(comm) on `world_size` threads, one rank each, over the inproc transport, and returns
// when all are done. If any rank throws, that rank fails its communicator (so its peers end with
// CommError rather than wait), and the first exception by rank order is rethrown here after
// every thread has finished. `timeout` applies to every communicator made.
void run_inproc(int world_size, const std::function<void(Communicator& comm)>& fn,
                std::chrono::milliseconds timeout = std::chrono::minutes(5));

// Like run_inproc, but returns each rank's exception (null where the rank succeeded) instead of
// rethrowing: for tests of failures.
std::vector<std::exception_ptr> run_inproc_collect(int world_size, const std::function<void(Communicator& comm)>& fn,
                                                   std::chrono::milliseconds timeout = std::chrono::minutes(5));

// The world communicator of an MPI job, initialising MPI on first use (asking for
// MPI_THREAD_SERIALIZED, requiring at least MPI_THREAD_FUNNELED) unless the program did. Each call
// returns a new communicator over its own duplicate of MPI_COMM_WORLD (the program's own messages
// never mix with ringflash's), so it is collective: every process calls it, in the same order;
// CommError if they have not all done so within 5 minutes. Throws NotSupported if this build has no
// MPI. MPI is finalised at exit if ringflash initialised it.
std::unique_ptr<Communicator> mpi_world();

// NCCL's unique id: rank 0 makes it, and every rank passes the same bytes to nccl_communicator.
struct NcclUniqueId {
  unsigned char bytes[128];
};
NcclUniqueId nccl_unique_id();

// A communicator of `size` GPU ranks over NCCL, this rank on CUDA device `device`. Collective: every
// rank calls it with the same id; CommError if they have not all done so within `timeout`.
// Messages in device memory are stream-ordered on stream() (see above); messages in host memory
// go through a device buffer while the host waits. Every wait has the deadline `timeout`: a
// watchdog aborts the world's NCCL communicators when an operation is late or NCCL reports an
// error, and the calls that follow throw CommError. fail() aborts them too; peers learn of it only
// by their deadlines. Operations captured into a CUDA graph have no deadline. Throws NotSupported
// if this build has no NCCL.
std::unique_ptr<Communicator> nccl_communicator(const NcclUniqueId& id, int rank, int size, int device,
                                                std::chrono::milliseconds timeout = std::chrono::minutes(5));

// The same, with rank 0's id sent to the others over `bootstrap` (mpi_world(), a torch bridge, ...),
// whose ranks, size and timeout it takes. Collective over `bootstrap`.
std::unique_ptr<Communicator> nccl_communicator(Communicator& bootstrap, int device);

}  // namespace ringflash
