// MPI transport: one rank per process of an MPI job.
//
// mpi_world() duplicates MPI_COMM_WORLD (MPI_Comm_idup, polled under a deadline), so ringflash's
// messages never meet the program's own. Waits poll MPI_Testsome under the communicator's deadline;
// nothing blocks inside MPI except MPI_Comm_split, which runs only after a deadline-guarded exchange
// has shown that every rank of the parent is there. The collectives are comm.cpp's, built on
// send_recv.
//
// Failures. The communicators made from one mpi_world() (it, and everything split from it) form a
// family with one failure state, as the ranks of one run_inproc do. fail(reason) sends the reason
// to every other rank on the family's root communicator under a control tag; every wait also probes
// for those messages and fails at once when a peer it still waits on has failed. A wait that fails
// fails its own rank the same way, so a failure reaches every rank without waiting out deadlines.
//
// Buffers. A send copies its payload at post time into a buffer the transport owns (as inproc does),
// so the caller's send buffer is free at once and a send that can never complete holds none of the
// caller's memory. Receives that are given up (deadline, failed peer, unwinding) are cancelled (one
// that MPI has already matched gets up to kCancelGrace to finish). A family that gave up on
// something keeps its MPI communicators and buffers to the end of the process: freed, a
// communicator's context id could be reused by a later one, which would then receive the stale
// messages.
//
// Open MPI makes no progress between MPI calls: a small (eager) message leaves when it is posted,
// but a large (rendezvous) one moves only while both ranks are inside MPI, in practice inside the
// receiver's wait.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "../../core/backends.h"
#include "../../core/check.h"
#include "ringflash/comm.h"
#include "ringflash/errors.h"

namespace ringflash::comm::mpi {

bool is_available() { return true; }

std::string describe() {
  int major = 0, minor = 0;
  MPI_Get_version(&major, &minor);
  return "compiled in (MPI " + std::to_string(major) + "." + std::to_string(minor) + ")";
}

namespace {

using Clock = std::chrono::steady_clock;
using core::str_cat;

constexpr int kDataTag = 1;
constexpr int kControlTag = 2;
// MPI counts are ints: larger messages go as several pieces of at most this many bytes.
constexpr size_t kMaxPieceBytes = size_t{1} << 30;
// A failure reason is cut to this length, which keeps its message within Open MPI's eager limit
// (sent without the receiver's help).
constexpr size_t kMaxReasonBytes = 1024;
// A wait polls without sleeping for this long, then sleeps this long between polls.
constexpr auto kSpinTime = std::chrono::microseconds(500);
constexpr auto kPollSleep = std::chrono::microseconds(50);
// How long a cancelled receive may take to complete before it is left to MPI.
constexpr auto kCancelGrace = std::chrono::seconds(1);
// mpi_world()'s deadline for every rank to arrive (Communicator's default).
constexpr std::chrono::milliseconds kWorldTimeout = std::chrono::minutes(5);

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return str_cat("MPI error ", code);
  return std::string(text, static_cast<size_t>(length));
}

// The one check behind every MPI call: a CommError made of the context and MPI's own words.
#define RINGFLASH_MPI_CHECK(call, ...)                                                                        \
  do {                                                                                                        \
    const int ringflash_mpi_rc_ = (call);                                                                     \
    RINGFLASH_CHECK(ringflash_mpi_rc_ == MPI_SUCCESS, CommError, __VA_ARGS__, mpi_error_text(ringflash_mpi_rc_)); \
  } while (0)

std::string seconds_text(std::chrono::milliseconds t) { return str_cat(static_cast<double>(t.count()) / 1000.0); }

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

void finalize_at_exit() {
  if (!mpi_finalized()) MPI_Finalize();
}

// MPI up, initialised by ringflash (finalised at exit) unless the program did it.
void ensure_initialized() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  RINGFLASH_CHECK(!mpi_finalized(), CommError, "[mpi_world] MPI has already been finalised");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = 0;
  RINGFLASH_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "[mpi_world] MPI_Init_thread: ");
  std::atexit(finalize_at_exit);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  RINGFLASH_CHECK(provided >= MPI_THREAD_FUNNELED, NotSupported,
                  "[mpi_world] MPI must support at least MPI_THREAD_FUNNELED, got thread level ", provided);
}

// Buffers that MPI may still read (sends and receives given up on) live until the process ends,
// in a list that stays reachable, so leak checkers do not report them.
void keep_until_exit(std::vector<std::unique_ptr<char[]>>& buffers) {
  static std::mutex mutex;
  static auto* kept = new std::vector<std::unique_ptr<char[]>>();  // never destroyed
  std::lock_guard<std::mutex> lock(mutex);
  for (auto& b : buffers) kept->push_back(std::move(b));
  buffers.clear();
}

// The communicators of one mpi_world() and their shared failure state.
struct Family {
  MPI_Comm root;  // the duplicate of MPI_COMM_WORLD; control messages travel here
  int root_rank = 0;
  std::vector<std::string> failed;  // why each root rank failed; "" while not known to have
  bool self_failed = false;
  std::string self_reason;
  // Something was given up on (see the top of the file): keep the communicators and these.
  bool keep = false;
  std::vector<std::unique_ptr<char[]>> kept_payloads;

  Family(MPI_Comm root_, int rank, int size) : root(root_), root_rank(rank), failed(static_cast<size_t>(size)) {}
  ~Family() {
    if (keep) {
      keep_until_exit(kept_payloads);
      return;
    }
    if (!mpi_finalized()) MPI_Comm_free(&root);
  }

  void mark_failed(int rank, const std::string& reason) {
    std::string& r = failed[static_cast<size_t>(rank)];
    if (r.empty()) r = reason.empty() ? "(no reason given)" : reason;
  }

  // Takes in every control message that has arrived.
  void poll_control() {
    for (;;) {
      int flag = 0;
      MPI_Message message;
      MPI_Status status;
      if (MPI_Improbe(MPI_ANY_SOURCE, kControlTag, root, &flag, &message, &status) != MPI_SUCCESS || !flag) return;
      int count = 0;
      MPI_Get_count(&status, MPI_CHAR, &count);
      std::string reason(static_cast<size_t>(std::max(count, 0)), '\0');
      if (MPI_Mrecv(reason.data(), count, MPI_CHAR, &message, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
      mark_failed(status.MPI_SOURCE, reason);
    }
  }
};

class MpiComm;

// The MPI requests of one send_recv: one or more pieces per op.
class MpiRequest final : public CommRequest {
 public:
  struct Piece {
    size_t op;     // index into the call's ops
    size_t bytes;  // expected, for a receive
  };

  MpiRequest(MpiComm& comm, const char* op, std::vector<P2POp> ops)
      : comm_(comm), op_(op), ops_(std::move(ops)), unwinding_at_post_(std::uncaught_exceptions()) {}

  // Waits, or while an exception unwinds past the request, gives it up at once (cancelling its
  // receives), so that the rank's failure is not delayed by a wait.
  ~MpiRequest() override;

  void wait() override;

  // Posts the pieces; on an MPI error gives up what was posted and throws.
  void post();
  // Cancels what is still pending; see the top of the file.
  void give_up();

 private:
  // Why the pieces still pending cannot complete, or "" while they may.
  std::string blocked_reason(bool expired) const;

  MpiComm& comm_;
  const char* op_;
  std::vector<P2POp> ops_;
  std::vector<Piece> pieces_;
  std::vector<MPI_Request> requests_;  // one per piece; MPI_REQUEST_NULL once complete
  std::vector<std::unique_ptr<char[]>> payloads_;  // the sends' copies
  int unwinding_at_post_;
  bool done_ = false;
};

class MpiComm final : public Communicator {
 public:
  MpiComm(std::shared_ptr<Family> family, MPI_Comm comm, bool owned, std::vector<int> root_ranks,
          std::chrono::milliseconds timeout)
      : family_(std::move(family)), comm_(comm), owned_(owned), root_ranks_(std::move(root_ranks)) {
    MPI_Comm_rank(comm_, &rank_);
    timeout_ = timeout;
  }

  ~MpiComm() override {
    if (owned_ && !family_->keep && !mpi_finalized()) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(root_ranks_.size()); }
  std::string transport() const override { return "mpi"; }

  std::unique_ptr<Communicator> split(int color, int key) override;

  std::unique_ptr<CommRequest> send_recv(const std::vector<P2POp>& ops) override { return post("send_recv", ops); }

  void fail(const std::string& reason) override;

  Family& family() { return *family_; }
  MPI_Comm handle() const { return comm_; }
  int root_rank_of(int peer) const { return root_ranks_[static_cast<size_t>(peer)]; }
  // Why `peer` failed, or "" while it is not known to have.
  const std::string& failure_of(int peer) const { return family_->failed[static_cast<size_t>(root_rank_of(peer))]; }
  using Communicator::end_wait;
  using Communicator::prefix;

 private:
  std::unique_ptr<MpiRequest> post(const char* op, const std::vector<P2POp>& ops);

  std::shared_ptr<Family> family_;
  MPI_Comm comm_;
  bool owned_;  // freed with this object (the root is the family's)
  std::vector<int> root_ranks_;
  int rank_ = 0;
};

void MpiComm::fail(const std::string& reason) {
  Family& f = *family_;
  if (f.self_failed) return;
  f.self_failed = true;
  f.self_reason = reason.empty() ? "(no reason given)" : reason;
  f.keep = true;
  if (mpi_finalized()) return;
  // One copy of the reason serves every send; the requests are freed at once and complete on
  // their own (eager), so fail() never waits.
  const std::string text = f.self_reason.substr(0, kMaxReasonBytes);
  std::unique_ptr<char[]> payload(new char[text.size() + 1]);
  std::memcpy(payload.get(), text.data(), text.size());
  int root_size = 0;
  MPI_Comm_size(f.root, &root_size);
  for (int j = 0; j < root_size; ++j) {
    if (j == f.root_rank) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(payload.get(), static_cast<int>(text.size()), MPI_CHAR, j, kControlTag, f.root, &request) ==
        MPI_SUCCESS)
      MPI_Request_free(&request);
  }
  f.kept_payloads.push_back(std::move(payload));
}

std::unique_ptr<MpiRequest> MpiComm::post(const char* op, const std::vector<P2POp>& ops) {
  check_ops(op, ops);
  RINGFLASH_CHECK(!family_->self_failed, CommError, prefix(op), "this rank has failed: ", family_->self_reason);
  auto request = std::make_unique<MpiRequest>(*this, op, ops);
  request->post();
  uint64_t to_others = 0;
  for (const P2POp& o : ops)
    if (o.kind == P2POp::Kind::kSend && o.peer != rank_) to_others += o.bytes;
  stats_.bytes_sent += to_others;
  return request;
}

void MpiRequest::post() {
  const MPI_Comm comm = comm_.handle();
  try {
    for (size_t i = 0; i < ops_.size(); ++i) {
      const P2POp& o = ops_[i];
      char* data = static_cast<char*>(o.data);
      if (o.kind == P2POp::Kind::kSend && o.bytes > 0) {
        payloads_.emplace_back(new char[o.bytes]);
        std::memcpy(payloads_.back().get(), o.data, o.bytes);
        data = payloads_.back().get();
      }
      size_t offset = 0;
      do {
        const size_t bytes = std::min(o.bytes - offset, kMaxPieceBytes);
        pieces_.push_back({i, bytes});
        requests_.push_back(MPI_REQUEST_NULL);
        MPI_Request* r = &requests_.back();
        const int count = static_cast<int>(bytes);
        if (o.kind == P2POp::Kind::kSend)
          RINGFLASH_MPI_CHECK(MPI_Isend(data + offset, count, MPI_BYTE, o.peer, kDataTag, comm, r), comm_.prefix(op_),
                              "MPI_Isend to rank ", o.peer, ": ");
        else
          RINGFLASH_MPI_CHECK(MPI_Irecv(data + offset, count, MPI_BYTE, o.peer, kDataTag, comm, r), comm_.prefix(op_),
                              "MPI_Irecv from rank ", o.peer, ": ");
        offset += bytes;
      } while (offset < o.bytes);
    }
  } catch (const CommError& e) {
    done_ = true;
    give_up();
    comm_.fail(e.what());
    throw;
  }
}

MpiRequest::~MpiRequest() {
  if (done_) return;
  if (std::uncaught_exceptions() > unwinding_at_post_) {
    done_ = true;
    give_up();
    return;
  }
  try {
    wait();
  } catch (...) {  // the destructor swallows errors (comm.h); the rank is marked failed already
  }
}

void MpiRequest::give_up() {
  if (mpi_finalized()) return;
  Family& family = comm_.family();
  bool kept = false;
  const Clock::time_point deadline = Clock::now() + kCancelGrace;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    MPI_Request& r = requests_[i];
    if (r == MPI_REQUEST_NULL) continue;
    kept = true;
    if (ops_[pieces_[i].op].kind == P2POp::Kind::kSend) {
      // Open MPI cannot cancel a send; it completes on its own from the kept payload.
      MPI_Request_free(&r);
      continue;
    }
    MPI_Cancel(&r);
    int flag = 0;
    while (MPI_Test(&r, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && !flag && Clock::now() < deadline)
      std::this_thread::sleep_for(kPollSleep);
    if (!flag && r != MPI_REQUEST_NULL) MPI_Request_free(&r);
  }
  if (kept) {
    family.keep = true;
    for (auto& payload : payloads_) family.kept_payloads.push_back(std::move(payload));
  }
}

std::string MpiRequest::blocked_reason(bool expired) const {
  const Family& family = comm_.family();
  if (family.self_failed) return str_cat(comm_.prefix(op_), "this rank has failed: ", family.self_reason);
  // Receives first: they are what a failed peer leaves hanging.
  for (const P2POp::Kind kind : {P2POp::Kind::kRecv, P2POp::Kind::kSend}) {
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const P2POp& o = ops_[pieces_[i].op];
      if (requests_[i] == MPI_REQUEST_NULL || o.kind != kind) continue;
      const std::string& failure = comm_.failure_of(o.peer);
      if (failure.empty()) continue;
      return kind == P2POp::Kind::kRecv
                 ? str_cat(comm_.prefix(op_), "no message from rank ", o.peer, ", which failed: ", failure)
                 : str_cat(comm_.prefix(op_), "rank ", o.peer, " failed before it took a message: ", failure);
    }
  }
  if (!expired) return "";
  for (const P2POp::Kind kind : {P2POp::Kind::kRecv, P2POp::Kind::kSend}) {
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const P2POp& o = ops_[pieces_[i].op];
      if (requests_[i] == MPI_REQUEST_NULL || o.kind != kind) continue;
      const std::string within = str_cat(" within ", seconds_text(comm_.timeout()), " s");
      return kind == P2POp::Kind::kRecv
                 ? str_cat(comm_.prefix(op_), "no message from rank ", o.peer, within)
                 : str_cat(comm_.prefix(op_), "rank ", o.peer, " did not take a message", within);
    }
  }
  return "";
}

void MpiRequest::wait() {
  if (done_) return;
  done_ = true;
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + comm_.timeout();
  const int n = static_cast<int>(requests_.size());
  std::vector<int> indices(requests_.size());
  std::vector<MPI_Status> statuses(requests_.size());
  std::string error;
  int pending = n;
  while (pending > 0 && error.empty()) {
    // Control messages first: a peer sends its data before it fails, so data that is already
    // here completes below rather than being taken for lost.
    comm_.family().poll_control();
    int completed = 0;
    const int rc = MPI_Testsome(n, requests_.data(), &completed, indices.data(), statuses.data());
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
      error = str_cat(comm_.prefix(op_), "MPI_Testsome: ", mpi_error_text(rc));
      break;
    }
    if (completed == MPI_UNDEFINED) completed = 0;
    pending -= completed;
    for (int c = 0; c < completed && error.empty(); ++c) {
      const Piece& p = pieces_[static_cast<size_t>(indices[c])];
      const P2POp& o = ops_[p.op];
      const MPI_Status& s = statuses[c];
      if (rc == MPI_ERR_IN_STATUS && s.MPI_ERROR != MPI_SUCCESS) {
        error = s.MPI_ERROR == MPI_ERR_TRUNCATE
                    ? str_cat(comm_.prefix(op_), "the message from rank ", o.peer, " is larger than its receive's ",
                              o.bytes, " bytes (", mpi_error_text(s.MPI_ERROR), ")")
                    : str_cat(comm_.prefix(op_), o.kind == P2POp::Kind::kSend ? "sending to" : "receiving from",
                              " rank ", o.peer, ": ", mpi_error_text(s.MPI_ERROR));
      } else if (o.kind == P2POp::Kind::kRecv) {
        int count = 0;
        MPI_Get_count(&s, MPI_BYTE, &count);
        if (static_cast<size_t>(count) != p.bytes)
          error = p.bytes == o.bytes ? str_cat(comm_.prefix(op_), "the message from rank ", o.peer, " has ", count,
                                               " bytes, but its receive expects ", o.bytes, " bytes")
                                     : str_cat(comm_.prefix(op_), "the message from rank ", o.peer,
                                               " is shorter than its receive's ", o.bytes, " bytes");
      }
    }
    if (!error.empty() || pending == 0) break;
    const Clock::time_point now = Clock::now();
    error = blocked_reason(now >= deadline);
    if (!error.empty()) break;
    if (now - start < kSpinTime)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(kPollSleep);
  }
  if (!error.empty()) give_up();
  comm_.end_wait(start, error);
}

std::unique_ptr<Communicator> MpiComm::split(int color, int key) {
  // Every rank's (color, key), under the deadline: afterwards MPI_Comm_split cannot wait on an
  // absent rank. The members come by (key, parent rank), as MPI orders them too.
  const std::vector<int> members = split_members(color, key);
  std::vector<int> root_ranks;
  for (int m : members) root_ranks.push_back(root_rank_of(m));

  MPI_Comm sub = MPI_COMM_NULL;
  try {
    RINGFLASH_MPI_CHECK(MPI_Comm_split(comm_, color, key, &sub), prefix("split"), "MPI_Comm_split: ");
    MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    auto c = std::make_unique<MpiComm>(family_, sub, true, std::move(root_ranks), timeout_);
    const int expected = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    RINGFLASH_CHECK(c->rank() == expected, CommError, prefix("split"), "MPI_Comm_split made this rank ", c->rank(),
                    " of the new communicator, expected ", expected);
    return c;
  } catch (const CommError& e) {
    fail(e.what());
    throw;
  }
}

}  // namespace
}  // namespace ringflash::comm::mpi

namespace ringflash {

std::unique_ptr<Communicator> mpi_world() {
  using namespace comm::mpi;
  ensure_initialized();
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const std::string prefix = core::str_cat("[mpi_world] rank ", rank, " of ", size, ": ");

  MPI_Comm root = MPI_COMM_NULL;
  MPI_Request request = MPI_REQUEST_NULL;
  RINGFLASH_MPI_CHECK(MPI_Comm_idup(MPI_COMM_WORLD, &root, &request), prefix, "MPI_Comm_idup: ");
  const Clock::time_point deadline = Clock::now() + kWorldTimeout;
  for (;;) {
    int flag = 0;
    RINGFLASH_MPI_CHECK(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), prefix, "MPI_Comm_idup: ");
    if (flag) break;
    RINGFLASH_CHECK(Clock::now() < deadline, CommError, prefix, "not every rank called mpi_world within ",
                    seconds_text(kWorldTimeout), " s");
    std::this_thread::sleep_for(kPollSleep);
  }
  MPI_Comm_set_errhandler(root, MPI_ERRORS_RETURN);

  auto family = std::make_shared<Family>(root, rank, size);
  std::vector<int> ranks(static_cast<size_t>(size));
  std::iota(ranks.begin(), ranks.end(), 0);
  return std::make_unique<MpiComm>(std::move(family), root, false, std::move(ranks), kWorldTimeout);
}

}  // namespace ringflash
