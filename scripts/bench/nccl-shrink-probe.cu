// What a GPU group that goes on without a lost rank (#55) costs at the NCCL level, measured
// before the nccl backend is built on it: two processes, one GPU each, a non-blocking
// communicator; rank 1 is killed (kill -9) while rank 0 waits in an all-reduce it will never
// join. Rank 0 then
//   A) ncclCommShrink(NCCL_SHRINK_ABORT) without rank 1: how long, whether the stream with the
//      stuck kernel comes back, and a collective and a captured CUDA graph on the new
//      communicator;
//   B) (second run, `abort`) ncclCommAbort and a new 1-rank communicator from a fresh id.
// Usage: nccl-shrink-probe RANK IDFILE shrink|abort   (scripts/bench/nccl-shrink-probe.sh)
#include <cuda_runtime.h>
#include <nccl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#define CK(x)                                                                 \
  do {                                                                        \
    cudaError_t e = (x);                                                      \
    if (e != cudaSuccess) {                                                   \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,              \
              cudaGetErrorString(e));                                         \
      exit(1);                                                                \
    }                                                                         \
  } while (0)

static double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// Waits for a non-blocking communicator's pending call; returns its result.
static ncclResult_t settle(ncclComm_t c, double limit_ms) {
  double t0 = now_ms();
  ncclResult_t r = ncclInProgress;
  while (r == ncclInProgress) {
    if (ncclCommGetAsyncError(c, &r) != ncclSuccess) return ncclInternalError;
    if (now_ms() - t0 > limit_ms) return ncclInProgress;
    if (r == ncclInProgress) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return r;
}

static ncclComm_t init(int rank, int world, ncclUniqueId id) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  // BLOCKING=1: a blocking communicator, as the nccl backend makes (ncclCommInitRank).
  cfg.blocking = getenv("BLOCKING") ? 1 : 0;
  ncclComm_t c;
  ncclResult_t r = ncclCommInitRankConfig(&c, world, id, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    fprintf(stderr, "init: %s\n", ncclGetErrorString(r));
    exit(1);
  }
  if (settle(c, 60000) != ncclSuccess) {
    fprintf(stderr, "init did not settle\n");
    exit(1);
  }
  return c;
}

static bool allreduce(ncclComm_t c, float* buf, size_t n, cudaStream_t s, double limit_ms) {
  ncclResult_t r = ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, c, s);
  if (r != ncclSuccess && r != ncclInProgress) return false;
  if (settle(c, limit_ms) != ncclSuccess) return false;
  double t0 = now_ms();
  while (cudaStreamQuery(s) == cudaErrorNotReady) {
    if (now_ms() - t0 > limit_ms) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  int rank = atoi(argv[1]);
  std::string idfile = argv[2], mode = argv[3];
  std::string pidfile = idfile + ".pid1";
  ncclUniqueId id;
  if (rank == 0) {
    ncclGetUniqueId(&id);
    FILE* f = fopen((idfile + ".tmp").c_str(), "wb");
    fwrite(&id, sizeof id, 1, f);
    fclose(f);
    rename((idfile + ".tmp").c_str(), idfile.c_str());
  } else {
    FILE* f = nullptr;
    while (!(f = fopen(idfile.c_str(), "rb"))) usleep(1000);
    if (fread(&id, sizeof id, 1, f) != 1) return 1;
    fclose(f);
    f = fopen(pidfile.c_str(), "w");
    fprintf(f, "%d\n", (int)getpid());
    fclose(f);
  }
  CK(cudaSetDevice(rank));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t n = 1 << 20;  // 4 MiB of f32, a decode step's exchange order of magnitude
  float* buf;
  CK(cudaMalloc(&buf, n * sizeof(float)));
  CK(cudaMemset(buf, 0, n * sizeof(float)));
  double t = now_ms();
  ncclComm_t comm = init(rank, 2, id);
  double init_ms = now_ms() - t;
  for (int i = 0; i < 5; i++)
    if (!allreduce(comm, buf, n, s, 10000)) {
      fprintf(stderr, "rank %d: warm-up all-reduce failed\n", rank);
      return 1;
    }
  if (rank == 1) {
    // Waits to be killed, in the middle of nothing the peer can see.
    for (;;) pause();
  }
  printf("rank 0: 2-rank communicator up in %.1f ms\n", init_ms);
  // An all-reduce rank 1 will never join, then rank 1 killed under it. GRAPH=1: launched from
  // a captured graph, as the nccl backend's steps are.
  if (getenv("GRAPH")) {
    cudaGraph_t g0;
    cudaGraphExec_t ge0;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, comm, s);
    settle(comm, 1000);
    CK(cudaStreamEndCapture(s, &g0));
    CK(cudaGraphInstantiate(&ge0, g0, 0));
    CK(cudaGraphLaunch(ge0, s));
  } else {
    ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, comm, s);
  }
  settle(comm, 1000);
  usleep(200 * 1000);
  FILE* f = fopen(pidfile.c_str(), "r");
  int pid1 = 0;
  if (!f || fscanf(f, "%d", &pid1) != 1) return 1;
  fclose(f);
  kill(pid1, SIGKILL);
  double killed = now_ms();
  printf("rank 0: stream busy after the kill: %s\n",
         cudaStreamQuery(s) == cudaErrorNotReady ? "yes (the all-reduce waits for rank 1)" : "no");
  ncclComm_t next = nullptr;
  double t_new = 0;
  if (mode != "abort") {
    int exclude[1] = {1};
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    // shrink: our config, NCCL_SHRINK_ABORT; shrink-inherit: the parent's config (NULL);
    // revoke (NCCL >= 2.30): ncclCommRevoke first, then a default shrink.
    ncclConfig_t* conf = mode == "shrink" ? &cfg : nullptr;
    int flags = NCCL_SHRINK_ABORT;
    double t0 = now_ms();
    if (mode == "revoke") {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 0)
      ncclResult_t rv = ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT);
      ncclResult_t st = settle(comm, 60000);
      printf("rank 0: ncclCommRevoke %s, settled %s (%.1f ms)\n", ncclGetErrorString(rv),
             ncclGetErrorString(st), now_ms() - t0);
      flags = NCCL_SHRINK_DEFAULT;
#else
      printf("rank 0: no ncclCommRevoke before NCCL 2.30\n");
      return 1;
#endif
    }
    ncclResult_t r = ncclCommShrink(comm, exclude, 1, &next, conf, flags);
    // Non-blocking: the child is made by a job of the parent's; its handle comes with it.
    ncclResult_t sp = settle(comm, 60000);
    printf("rank 0: ncclCommShrink returned %s, parent settled %s (%.1f ms), new communicator %s\n",
           ncclGetErrorString(r), ncclGetErrorString(sp), now_ms() - t0, next ? "set" : "NULL");
    if ((r != ncclSuccess && r != ncclInProgress) || !next) return 1;
    ncclResult_t s2 = settle(next, 60000);
    t_new = now_ms() - t0;
    printf("rank 0: %s to 1 rank: %.1f ms, %s\n", mode.c_str(), t_new, ncclGetErrorString(s2));
  } else {
    double t0 = now_ms();
    ncclCommAbort(comm);
    double t_abort = now_ms() - t0;
    ncclUniqueId id2;
    ncclGetUniqueId(&id2);
    next = init(0, 1, id2);
    t_new = now_ms() - t0;
    printf("rank 0: abort %.1f ms, then a new 1-rank communicator: %.1f ms in all\n", t_abort, t_new);
  }
  // Is the stream usable again (the stuck kernel gone)?
  double t1 = now_ms();
  cudaError_t e = cudaStreamSynchronize(s);
  printf("rank 0: stream synchronize after: %s (%.1f ms)\n", cudaGetErrorString(e), now_ms() - t1);
  if (e != cudaSuccess) {
    cudaGetLastError();
    cudaStreamDestroy(s);
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    printf("rank 0: a new stream\n");
  }
  CK(cudaMemset(buf, 0, n * sizeof(float)));
  double t2 = now_ms();
  bool ok = allreduce(next, buf, n, s, 10000);
  printf("rank 0: all-reduce on the new communicator: %s (%.2f ms, first)\n", ok ? "ok" : "FAILED",
         now_ms() - t2);
  // A captured graph of it, replayed (the backend's steps are graphs).
  cudaGraph_t g;
  cudaGraphExec_t ge;
  double t3 = now_ms();
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, next, s);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  double t_cap = now_ms() - t3;
  for (int i = 0; i < 10; i++) CK(cudaGraphLaunch(ge, s));
  e = cudaStreamSynchronize(s);
  printf("rank 0: graph captured in %.2f ms on the new communicator, 10 replays: %s\n", t_cap,
         cudaGetErrorString(e));
  printf("rank 0: from the kill to a collective on the new communicator: %.1f ms\n", now_ms() - killed);
  return ok && e == cudaSuccess ? 0 : 1;
}
