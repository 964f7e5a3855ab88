/* memcheck's own allocator (repro.run.own_alloc builds this file with nvcc on the machine that runs it; no binary is
 * kept in the project). One cudaMalloc per tensor, so compute-sanitizer memcheck knows each tensor's exact bounds
 * (torch's caching allocator packs tensors into segments, where an over-read lands in valid memory and memcheck
 * stays quiet: results/h200-vllm, issue 31).
 *
 * CUDA graphs: memory allocated while a capture is underway (repro_own_capture(1) from Python, or the stream itself
 * capturing) belongs to the graph, which replays into it later: it is never freed. So is memory freed while a
 * capture is underway (a graph may still use it; cudaFree synchronizes, which a capture forbids). Everything else is
 * freed at once. cudaMalloc during a capture runs in the relaxed capture mode, as torch's caching allocator does.
 *
 * Built with -DREPRO_OWN_GUARD (REPRO_OWN_ALLOC_GUARD=1): each tensor sits between two guards as large as itself
 * (GUARD_MIN to GUARD_MAX bytes) inside one cudaMalloc, which is registered with compute-sanitizer as a pool (NVTX
 * memory API, nvtxMemHeapRegister) whose one region is the tensor: a read past the tensor by up to its own size is
 * reported, where --padding's fixed guard would let it land in the next allocation.
 *
 * torch.cuda.memory.CUDAPluggableAllocator(path, "repro_own_malloc", "repro_own_free"); counters through
 * repro_own_counters (allocations, frees, kept, bytes now, peak bytes, failed allocations). */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/types.h>

#ifdef __cplusplus
#define EXPORT extern "C" __attribute__((visibility("default")))
#else
#define EXPORT __attribute__((visibility("default")))
#endif

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static volatile int capturing = 0; /* captures underway (repro_own_capture(1) / (0) from Python): a count */
static int fill = -1; /* a byte every new allocation is filled with (repro_own_fill), -1: none */
static uint64_t n_alloc = 0, n_free = 0, n_kept = 0, n_failed = 0;
static uint64_t bytes_now = 0, bytes_peak = 0;

/* the graph-owned allocations: an open-addressing set of pointers (never removed), with their sizes */
typedef struct {
    void *ptr;
    size_t size;
} slot_t;
static slot_t *graph = NULL;
static size_t graph_cap = 0, graph_len = 0;

static size_t hash(void *p, size_t cap) { return (size_t)(((uintptr_t)p >> 8) * 11400714819323198485ull) & (cap - 1); }

#ifdef REPRO_OWN_GUARD
#include <nvtx3/nvToolsExtMem.h>
#define GUARD_MIN ((size_t)65536)
#define GUARD_MAX ((size_t)64 << 20)
#define BUCKETS 65536
typedef struct node {
    void *user, *base;
    nvtxMemHeapHandle_t heap;
    struct node *next;
} node_t;
static node_t *buckets[BUCKETS];
static nvtxDomainHandle_t domain = NULL;
static pthread_mutex_t guard_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t guard_of(size_t n) {
    size_t g = n < GUARD_MIN ? GUARD_MIN : n > GUARD_MAX ? GUARD_MAX : n;
    return (g + 511) & ~(size_t)511; /* the tensor stays 512-byte aligned, as cudaMalloc's are */
}

static cudaError_t dev_alloc(void **user, size_t n) {
    size_t g = guard_of(n), total = g + ((n + 511) & ~(size_t)511) + g;
    void *base = NULL;
    cudaError_t e = cudaMalloc(&base, total);
    if (e != cudaSuccess) return e;
    node_t *nd = (node_t *)malloc(sizeof(node_t));
    if (!nd) {
        cudaFree(base);
        return cudaErrorMemoryAllocation;
    }
    nd->base = base;
    nd->user = (char *)base + g;
    pthread_mutex_lock(&guard_lock);
    if (!domain) domain = nvtxDomainCreateA("repro-own-alloc");
    nvtxMemVirtualRangeDesc_t pool = {total, base};
    nvtxMemHeapDesc_t hd = {};
    hd.extCompatID = NVTX_EXT_COMPATID_MEM;
    hd.structSize = sizeof(hd);
    hd.usage = NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR;
    hd.type = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    hd.typeSpecificDescSize = sizeof(pool);
    hd.typeSpecificDesc = &pool;
    nd->heap = nvtxMemHeapRegister(domain, &hd);
    nvtxMemVirtualRangeDesc_t region = {n, nd->user};
    nvtxMemRegionsRegisterBatch_t rb = {};
    rb.extCompatID = NVTX_EXT_COMPATID_MEM;
    rb.structSize = sizeof(rb);
    rb.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    rb.heap = nd->heap;
    rb.regionCount = 1;
    rb.regionDescElementSize = sizeof(region);
    rb.regionDescElements = &region;
    nvtxMemRegionsRegister(domain, &rb);
    size_t b = hash(nd->user, BUCKETS);
    nd->next = buckets[b];
    buckets[b] = nd;
    pthread_mutex_unlock(&guard_lock);
    *user = nd->user;
    return cudaSuccess;
}

static void dev_free(void *user) {
    pthread_mutex_lock(&guard_lock);
    node_t **at = &buckets[hash(user, BUCKETS)];
    while (*at && (*at)->user != user) at = &(*at)->next;
    node_t *nd = *at;
    if (nd) {
        *at = nd->next;
        nvtxMemHeapUnregister(domain, nd->heap);
    }
    pthread_mutex_unlock(&guard_lock);
    if (nd) {
        cudaFree(nd->base);
        free(nd);
    }
}
#else
static cudaError_t dev_alloc(void **user, size_t n) { return cudaMalloc(user, n); }
static void dev_free(void *user) { cudaFree(user); }
#endif

static int graph_insert(void *p, size_t size) {
    if (2 * (graph_len + 1) > graph_cap) {
        size_t cap = graph_cap ? 2 * graph_cap : 4096;
        slot_t *t = (slot_t *)calloc(cap, sizeof(slot_t));
        if (!t) return 0;
        for (size_t i = 0; i < graph_cap; i++)
            if (graph[i].ptr) {
                size_t j = hash(graph[i].ptr, cap);
                while (t[j].ptr) j = (j + 1) & (cap - 1);
                t[j] = graph[i];
            }
        free(graph);
        graph = t;
        graph_cap = cap;
    }
    size_t j = hash(p, graph_cap);
    while (graph[j].ptr && graph[j].ptr != p) j = (j + 1) & (graph_cap - 1);
    if (!graph[j].ptr) graph_len++;
    graph[j].ptr = p;
    graph[j].size = size;
    return 1;
}

static int graph_has(void *p) {
    if (!graph_cap) return 0;
    size_t j = hash(p, graph_cap);
    while (graph[j].ptr) {
        if (graph[j].ptr == p) return 1;
        j = (j + 1) & (graph_cap - 1);
    }
    return 0;
}

/* 1: the stream captures, or cannot be asked (the legacy stream while a blocking stream captures answers
 * cudaErrorStreamCaptureImplicit): either way nothing may be freed or filled on it now */
static int stream_capturing(cudaStream_t stream) {
    enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) {
        (void)cudaGetLastError();
        return 1;
    }
    return st != cudaStreamCaptureStatusNone;
}

EXPORT void repro_own_capture(int on) { __sync_fetch_and_add(&capturing, on ? 1 : -1); }

/* new allocations read as leftovers would (the caching allocator hands out reused memory; a fresh cudaMalloc is
 * zeros in practice, which hides a kernel that reads what nobody wrote): filled on their stream, in stream order; in
 * a capture, only on the capturing stream (the fill is then a node of the graph, before the kernels that write) */
EXPORT void repro_own_fill(int byte) { fill = byte; }

EXPORT void *repro_own_malloc(ssize_t size, int device, cudaStream_t stream) {
    (void)device;
    void *p = NULL;
    size_t n = size > 0 ? (size_t)size : 1;
    int on_capturing_stream = stream_capturing(stream);
    int in_graph = capturing > 0 || on_capturing_stream;
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    cudaError_t e = dev_alloc(&p, n);
    cudaThreadExchangeStreamCaptureMode(&mode);
    pthread_mutex_lock(&lock);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        n_failed++;
        pthread_mutex_unlock(&lock);
        return NULL; /* torch raises its out-of-memory error */
    }
    if (in_graph && !graph_insert(p, n)) { /* not recorded as the graph's: it would be freed under the graph */
        n_failed++;
        pthread_mutex_unlock(&lock);
        dev_free(p);
        return NULL;
    }
    n_alloc++;
    bytes_now += n;
    if (bytes_now > bytes_peak) bytes_peak = bytes_now;
    pthread_mutex_unlock(&lock);
    /* filled in stream order: outside captures, or as a node of the capture on its capturing stream (a stream that
     * cannot be asked is left alone) */
    int askable = 1;
    if (on_capturing_stream) {
        enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
        askable = cudaStreamIsCapturing(stream, &st) == cudaSuccess;
        (void)cudaGetLastError();
    }
    if (fill >= 0 && askable && (capturing == 0 || on_capturing_stream)) {
        if (cudaMemsetAsync(p, fill, n, stream) != cudaSuccess) (void)cudaGetLastError();
    }
    return p;
}

EXPORT void repro_own_free(void *ptr, ssize_t size, int device, cudaStream_t stream) {
    (void)device;
    if (!ptr) return;
    pthread_mutex_lock(&lock);
    int keep = capturing > 0 || graph_has(ptr) || stream_capturing(stream);
    if (keep) {
        n_kept++;
        pthread_mutex_unlock(&lock);
        return;
    }
    n_free++;
    bytes_now -= size > 0 ? (size_t)size : 1;
    pthread_mutex_unlock(&lock);
    dev_free(ptr);
}

/* out[0..6]: allocations, frees, kept (freed by torch, kept for a graph), bytes now, peak bytes, failures,
 * allocations owned by graphs */
EXPORT void repro_own_counters(uint64_t *out) {
    pthread_mutex_lock(&lock);
    out[6] = graph_len;
    out[0] = n_alloc;
    out[1] = n_free;
    out[2] = n_kept;
    out[3] = bytes_now;
    out[4] = bytes_peak;
    out[5] = n_failed;
    pthread_mutex_unlock(&lock);
}

/* 1 when built with REPRO_OWN_GUARD (guards around each tensor, registered through NVTX) */
EXPORT int repro_own_guarded(void) {
#ifdef REPRO_OWN_GUARD
    return 1;
#else
    return 0;
#endif
}

EXPORT void repro_own_reset_peak(void) {
    pthread_mutex_lock(&lock);
    bytes_peak = bytes_now;
    pthread_mutex_unlock(&lock);
}
