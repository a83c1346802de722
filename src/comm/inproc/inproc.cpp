// inproc transport: one rank per thread in one process.
//
// run_inproc makes a World: each rank's state (running, returned, failed and why), a condition
// variable per rank, and the groups of ranks that its communicators span. A send copies its payload
// at post time into the receiver's mailbox, so the send buffer is free at once and a receive is
// completed by the receiving thread itself, inside wait(). It follows that a rank that has
// returned or failed will never send again: a receive from it that has not arrived fails at once
// rather than at the deadline.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>

#include "../../core/check.h"
#include "ringflash/comm.h"
#include "ringflash/errors.h"

namespace ringflash::comm::inproc {
namespace {

using Clock = std::chrono::steady_clock;
using core::str_cat;

// "0.3" for 300 ms, "300" for 5 minutes.
std::string seconds_text(std::chrono::milliseconds t) { return str_cat(static_cast<double>(t.count()) / 1000.0); }

std::string describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

struct Message {
  std::unique_ptr<char[]> data;  // null for a zero-byte message
  size_t bytes = 0;
};

// The messages from one rank to another on one communicator, numbered in posting order on both
// ends: the k-th receive posted matches the k-th send posted.
struct Channel {
  uint64_t sends_posted = 0;
  uint64_t receives_posted = 0;
  std::map<uint64_t, Message> arrived;  // by send number, until its receive takes it
};

// The ranks of one communicator (as world ranks, in communicator order) and its channels.
struct Group {
  uint64_t id;
  std::vector<int> world_ranks;
  std::vector<Channel> channels;  // [src * size + dst]

  Group(uint64_t id_, std::vector<int> ranks)
      : id(id_), world_ranks(std::move(ranks)), channels(world_ranks.size() * world_ranks.size()) {}
  int size() const { return static_cast<int>(world_ranks.size()); }
  Channel& channel(int src, int dst) { return channels[static_cast<size_t>(src) * world_ranks.size() + dst]; }
};

enum class Status { kRunning, kReturned, kFailed };

struct RankState {
  Status status = Status::kRunning;
  std::string reason;             // why it failed
  std::condition_variable wake;   // a message for this rank arrived, or some rank stopped
};

// Everything the ranks of one run_inproc share. `mutex` guards all of it.
struct World {
  std::mutex mutex;
  std::vector<RankState> ranks;
  uint64_t next_group_id = 0;
  // Communicators that split is making: (parent group, split number on the parent, color) ->
  // the new group, until every member has picked it up.
  struct Forming {
    std::shared_ptr<Group> group;
    size_t joined = 0;
  };
  std::map<std::tuple<uint64_t, uint64_t, int>, Forming> forming;

  explicit World(int size) : ranks(static_cast<size_t>(size)) {}

  // Marks a running rank as returned or failed (the first reason stays) and wakes every waiter,
  // since any of them may be waiting on it.
  void stop(int world_rank, Status status, const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      RankState& r = ranks[static_cast<size_t>(world_rank)];
      if (r.status != Status::kRunning) return;
      r.status = status;
      r.reason = reason;
    }
    for (RankState& r : ranks) r.wake.notify_all();
  }
};

class InprocComm;

// The receives of one send_recv (its sends were delivered when it was posted).
class InprocRequest final : public CommRequest {
 public:
  struct Receive {
    int peer;
    void* data;
    size_t bytes;
    uint64_t number;  // in the channel from `peer`
    bool done = false;
  };

  InprocRequest(InprocComm& comm, const char* op, std::vector<Receive> receives)
      : comm_(comm), op_(op), receives_(std::move(receives)), unwinding_at_post_(std::uncaught_exceptions()) {}

  // Waits unless the stack is unwinding past the request: then nothing writes to its buffers any
  // more (receives are completed only inside wait), and waiting could only delay the rank's
  // failure, which its peers are waiting to hear about.
  ~InprocRequest() override {
    if (done_ || std::uncaught_exceptions() > unwinding_at_post_) return;
    try {
      wait();
    } catch (...) {  // the destructor swallows errors (comm.h); the rank is marked failed already
    }
  }

  void wait() override;

 private:
  // Why the receives still pending cannot complete, or "" while they still may.
  std::string blocked_reason(World& world, Group& group, bool expired) const;

  InprocComm& comm_;
  const char* op_;
  std::vector<Receive> receives_;
  int unwinding_at_post_;
  bool done_ = false;
};

class InprocComm final : public Communicator {
 public:
  InprocComm(std::shared_ptr<World> world, std::shared_ptr<Group> group, int rank, std::chrono::milliseconds timeout)
      : world_(std::move(world)), group_(std::move(group)), rank_(rank) {
    timeout_ = timeout;
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string transport() const override { return "inproc"; }

  std::unique_ptr<Communicator> split(int color, int key) override;

  std::unique_ptr<CommRequest> send_recv(const std::vector<P2POp>& ops) override { return post("send_recv", ops); }

  void fail(const std::string& reason) override { world_->stop(world_rank(), Status::kFailed, reason); }

  World& world() { return *world_; }
  Group& group() { return *group_; }
  int world_rank() const { return group_->world_ranks[static_cast<size_t>(rank_)]; }
  using Communicator::end_wait;
  using Communicator::prefix;

 private:
  std::unique_ptr<InprocRequest> post(const char* op, const std::vector<P2POp>& ops);

  std::shared_ptr<World> world_;
  std::shared_ptr<Group> group_;
  int rank_;
  uint64_t splits_ = 0;  // split calls made on this communicator, the same count on every member
};

std::unique_ptr<InprocRequest> InprocComm::post(const char* op, const std::vector<P2POp>& ops) {
  check_ops(op, ops);

  // Copies of the payloads, made before taking the lock.
  std::vector<Message> payloads;
  uint64_t bytes_to_others = 0;
  for (const P2POp& o : ops) {
    if (o.kind != P2POp::Kind::kSend) continue;
    Message m;
    m.bytes = o.bytes;
    if (o.bytes > 0) {
      m.data.reset(new char[o.bytes]);
      std::memcpy(m.data.get(), o.data, o.bytes);
    }
    payloads.push_back(std::move(m));
    if (o.peer != rank_) bytes_to_others += o.bytes;
  }

  std::vector<InprocRequest::Receive> receives;
  std::set<int> woken;  // world ranks that got a message
  {
    std::lock_guard<std::mutex> lock(world_->mutex);
    const RankState& self = world_->ranks[static_cast<size_t>(world_rank())];
    if (self.status == Status::kFailed)
      throw CommError(str_cat(prefix(op), "this rank has failed: ", self.reason));
    size_t next_payload = 0;
    for (const P2POp& o : ops) {
      if (o.kind == P2POp::Kind::kSend) {
        Channel& c = group_->channel(rank_, o.peer);
        c.arrived.emplace(c.sends_posted++, std::move(payloads[next_payload++]));
        if (o.peer != rank_) woken.insert(group_->world_ranks[static_cast<size_t>(o.peer)]);
      } else {
        Channel& c = group_->channel(o.peer, rank_);
        receives.push_back({o.peer, o.data, o.bytes, c.receives_posted++});
      }
    }
  }
  for (int r : woken) world_->ranks[static_cast<size_t>(r)].wake.notify_all();
  stats_.bytes_sent += bytes_to_others;
  return std::make_unique<InprocRequest>(*this, op, std::move(receives));
}

std::string InprocRequest::blocked_reason(World& world, Group& group, bool expired) const {
  const RankState& self = world.ranks[static_cast<size_t>(comm_.world_rank())];
  if (self.status == Status::kFailed) return str_cat(comm_.prefix(op_), "this rank has failed: ", self.reason);
  for (const Receive& r : receives_) {
    if (r.done) continue;
    if (r.peer == comm_.rank())
      return str_cat(comm_.prefix(op_), "no message from rank ", r.peer,
                     " (this rank): no send to itself was posted before this wait");
    const RankState& peer = world.ranks[static_cast<size_t>(group.world_ranks[static_cast<size_t>(r.peer)])];
    if (peer.status == Status::kFailed)
      return str_cat(comm_.prefix(op_), "no message from rank ", r.peer, ", which failed: ", peer.reason);
    if (peer.status == Status::kReturned)
      return str_cat(comm_.prefix(op_), "no message from rank ", r.peer, ", which has returned without sending it");
  }
  if (expired) {
    for (const Receive& r : receives_)
      if (!r.done)
        return str_cat(comm_.prefix(op_), "no message from rank ", r.peer, " within ", seconds_text(comm_.timeout()),
                       " s");
  }
  return "";
}

void InprocRequest::wait() {
  if (done_) return;
  done_ = true;
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + comm_.timeout();
  World& world = comm_.world();
  Group& group = comm_.group();
  const int me = comm_.rank();
  RankState& self = world.ranks[static_cast<size_t>(comm_.world_rank())];

  std::string error;
  std::vector<std::pair<Receive*, Message>> taken;
  size_t pending = receives_.size();
  {
    std::unique_lock<std::mutex> lock(world.mutex);
    bool expired = false;
    while (pending > 0) {
      for (Receive& r : receives_) {
        if (r.done) continue;
        std::map<uint64_t, Message>& arrived = group.channel(r.peer, me).arrived;
        const auto it = arrived.find(r.number);
        if (it == arrived.end()) continue;
        if (it->second.bytes != r.bytes) {
          error = str_cat(comm_.prefix(op_), "the message from rank ", r.peer, " has ", it->second.bytes,
                          " bytes, but its receive expects ", r.bytes,
                          " bytes");
          break;
        }
        taken.emplace_back(&r, std::move(it->second));
        arrived.erase(it);
        r.done = true;
        --pending;
      }
      if (!error.empty()) break;
      if (!taken.empty()) {
        // Copy (and free the payloads) without holding up the other ranks.
        lock.unlock();
        for (auto& [r, m] : taken)
          if (m.bytes > 0) std::memcpy(r->data, m.data.get(), m.bytes);
        taken.clear();
        lock.lock();
        continue;
      }
      if (pending == 0) break;
      error = blocked_reason(world, group, expired);
      if (!error.empty()) break;
      expired = self.wake.wait_until(lock, deadline) == std::cv_status::timeout;
    }
  }
  comm_.end_wait(start, error);
}

std::unique_ptr<Communicator> InprocComm::split(int color, int key) {
  const uint64_t split_number = splits_++;
  const std::vector<int> members = split_members(color, key);
  std::vector<int> world_ranks;
  int new_rank = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    world_ranks.push_back(group_->world_ranks[static_cast<size_t>(members[i])]);
    if (members[i] == rank_) new_rank = static_cast<int>(i);
  }

  std::shared_ptr<Group> group;
  {
    std::lock_guard<std::mutex> lock(world_->mutex);
    const auto id = std::make_tuple(group_->id, split_number, color);
    World::Forming& f = world_->forming[id];
    if (!f.group) f.group = std::make_shared<Group>(world_->next_group_id++, std::move(world_ranks));
    group = f.group;
    if (++f.joined == members.size()) world_->forming.erase(id);
  }
  return std::make_unique<InprocComm>(world_, std::move(group), new_rank, timeout_);
}

}  // namespace
}  // namespace ringflash::comm::inproc

namespace ringflash {

std::vector<std::exception_ptr> run_inproc_collect(int world_size, const std::function<void(Communicator& comm)>& fn,
                                                   std::chrono::milliseconds timeout) {
  using namespace comm::inproc;
  RINGFLASH_CHECK(world_size >= 1, InvalidArgument, "[run_inproc] world_size must be >= 1, got ", world_size);
  RINGFLASH_CHECK(timeout.count() >= 0, InvalidArgument, "[run_inproc] timeout must be >= 0 ms, got ",
                  timeout.count(), " ms");
  RINGFLASH_CHECK(static_cast<bool>(fn), InvalidArgument, "[run_inproc] fn must not be empty");

  auto world = std::make_shared<World>(world_size);
  std::vector<int> ranks(static_cast<size_t>(world_size));
  std::iota(ranks.begin(), ranks.end(), 0);
  auto group = std::make_shared<Group>(world->next_group_id++, std::move(ranks));

  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  auto body = [&](int r) {
    try {
      InprocComm comm(world, group, r, timeout);
      fn(comm);
      world->stop(r, Status::kReturned, "");
    } catch (...) {
      errors[static_cast<size_t>(r)] = std::current_exception();
      world->stop(r, Status::kFailed, describe(errors[static_cast<size_t>(r)]));
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    try {
      threads.emplace_back(body, r);
    } catch (const std::system_error& e) {
      // The ranks without a thread count as failed, so the started ones do not wait for them.
      for (int k = r; k < world_size; ++k) {
        const std::string message =
            core::str_cat("[run_inproc] could not start the thread of rank ", k, " of ", world_size, ": ", e.what());
        errors[static_cast<size_t>(k)] = std::make_exception_ptr(CommError(message));
        world->stop(k, Status::kFailed, message);
      }
      break;
    }
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

void run_inproc(int world_size, const std::function<void(Communicator& comm)>& fn, std::chrono::milliseconds timeout) {
  for (const std::exception_ptr& e : run_inproc_collect(world_size, fn, timeout))
    if (e) std::rethrow_exception(e);
}

}  // namespace ringflash
