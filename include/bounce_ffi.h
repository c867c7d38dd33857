/*
 * The C boundary between the BOUNCE C++ shim (plugin/) and the Rust engine
 * (src/ffi/). Plain C: no C++ types cross it.
 *
 * Conventions
 * - Every function returns a NIXL status code (bounce_status_t, the values of
 *   nixl_status_t) and never throws or unwinds: the Rust side catches panics
 *   and returns BOUNCE_ERR_BACKEND (after a panic the engine is marked broken
 *   and refuses new work with BOUNCE_ERR_BACKEND; the calls that release
 *   resources still run, so that NIXL's teardown frees everything).
 * - Strings and byte blobs are passed as bounce_bytes_t {ptr, len}, BORROWED
 *   for the duration of the call only; they need not be NUL-terminated.
 * - Output strings are delivered through a bounce_sink_t callback that the
 *   caller provides; the callee calls it zero or more times during the call,
 *   and the caller copies the bytes (nothing allocated on one side is freed on
 *   the other).
 *
 * Handle ownership
 * - bounce_engine_t: created by bounce_engine_new, OWNED by the C++ engine
 *   object, destroyed exactly once by bounce_engine_free.
 * - bounce_md_t: created by bounce_engine_register_mem / _load_remote_md /
 *   _load_local_md, OWNED by the shim's metadata table, under the handle
 *   NIXL holds for the region (the UCX delegate's own metadata of it);
 *   returned exactly once to Rust by bounce_engine_deregister_mem (for
 *   registered memory) or bounce_engine_unload_md (for loaded metadata),
 *   which free it.
 * - bounce_req_t: created by bounce_engine_prep_xfer, OWNED by the C++
 *   request wrapper; freed exactly once by bounce_engine_release_req, which
 *   also aborts it if still running.
 *
 * The UCX delegate
 * - Transfers that take neither of BOUNCE's own paths are carried by NIXL's
 *   UCX engine, which the shim creates beside the Rust engine and calls
 *   directly (no second NIXL agent, no second preparation). The Rust side
 *   decides the route (prep_xfer's *delegate) and keeps the UCX engine's
 *   blobs inside its own metadata: the shim passes UCX's connection info and
 *   region public data in, and gets the peer's UCX parts back out.
 */
#ifndef NIXL_BOUNCE_FFI_H
#define NIXL_BOUNCE_FFI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t bounce_status_t;
#define BOUNCE_IN_PROG 1
#define BOUNCE_SUCCESS 0
#define BOUNCE_ERR_NOT_POSTED -1
#define BOUNCE_ERR_INVALID_PARAM -2
#define BOUNCE_ERR_BACKEND -3
#define BOUNCE_ERR_NOT_FOUND -4
#define BOUNCE_ERR_MISMATCH -5
#define BOUNCE_ERR_NOT_ALLOWED -6
#define BOUNCE_ERR_REPOST_ACTIVE -7
#define BOUNCE_ERR_UNKNOWN -8
#define BOUNCE_ERR_NOT_SUPPORTED -9
#define BOUNCE_ERR_REMOTE_DISCONNECT -10
#define BOUNCE_ERR_CANCELED -11

/* Memory kinds, numbered as nixl_mem_t. */
typedef int32_t bounce_mem_t;
#define BOUNCE_MEM_DRAM 0
#define BOUNCE_MEM_VRAM 1
#define BOUNCE_MEM_BLK 2
#define BOUNCE_MEM_OBJ 3
#define BOUNCE_MEM_FILE 4

/* Transfer direction, numbered as nixl_xfer_op_t. */
typedef int32_t bounce_op_t;
#define BOUNCE_OP_READ 0
#define BOUNCE_OP_WRITE 1

typedef struct bounce_engine bounce_engine_t;
typedef struct bounce_md bounce_md_t;
typedef struct bounce_req bounce_req_t;

typedef struct bounce_bytes {
    const uint8_t *ptr;
    size_t len;
} bounce_bytes_t;

/* One key/value backend parameter. */
typedef struct bounce_param {
    bounce_bytes_t key;
    bounce_bytes_t value;
} bounce_param_t;

/* One transfer descriptor, laid out as NIXL's own (nixlMetaDesc), so that the
 * shim passes NIXL's descriptor array in place: md is the backend metadata
 * NIXL resolved the descriptor to (the handle of its region: the UCX
 * delegate's metadata object), or NULL; the list's resolve() gives its
 * bounce_md_t. */
typedef struct bounce_desc {
    uintptr_t addr;
    size_t len;
    uint64_t dev_id;
    const void *md;
} bounce_desc_t;

/* The bounce_md_t of a descriptor's backend metadata (non-NULL), or NULL
 * when the handle is not one of this engine's; ctx is the list's
 * resolve_ctx. Called only during the call the list is given to, and maybe
 * from several threads at once (a large table is filled in parts): it must
 * only read (the shim holds its metadata table's lock for the call). */
typedef const bounce_md_t *(*bounce_md_resolver_t)(const void *ctx, const void *backend_md);

typedef struct bounce_desc_list {
    const bounce_desc_t *descs;
    size_t count;
    bounce_mem_t mem;
    bounce_md_resolver_t resolve;
    const void *resolve_ctx;
} bounce_desc_list_t;

/* The backend's optional per-transfer arguments. The notification is read
 * by bounce_engine_post_xfer only (NIXL passes it to every postXfer);
 * bounce_engine_prep_xfer reads the custom parameter. */
typedef struct bounce_xfer_args {
    int32_t has_notif;
    bounce_bytes_t notif_msg;
    bounce_bytes_t custom_param;
} bounce_xfer_args_t;

/* Receives one output byte string (called zero or more times). */
typedef void (*bounce_sink_t)(void *ctx, const uint8_t *ptr, size_t len);
/* Receives one notification: the sending agent's name and the message. */
typedef void (*bounce_notif_sink_t)(void *ctx, bounce_bytes_t agent, bounce_bytes_t msg);

/* ---- plugin-level (no engine) ---- */

/* The plugin's version string, NUL-terminated, static. */
const char *bounce_plugin_version(void);
/* Backend options with their defaults: calls sink(ctx, key) then
 * sink(ctx, default) for each option, in order. */
bounce_status_t bounce_plugin_options(bounce_sink_t sink, void *ctx);

/* ---- engine lifecycle ---- */

/* error_sink receives a human-readable reason when the status is not success. */
bounce_status_t bounce_engine_new(bounce_bytes_t local_agent,
                                  const bounce_param_t *params,
                                  size_t param_count,
                                  bounce_sink_t error_sink,
                                  void *error_ctx,
                                  bounce_engine_t **out);
void bounce_engine_free(bounce_engine_t *engine);
/* The backend parameters for the UCX delegate: calls sink(ctx, key) then
 * sink(ctx, value) for each. */
bounce_status_t bounce_engine_ucx_params(bounce_engine_t *engine, bounce_sink_t sink, void *ctx);
/* The UCX delegate's progress-thread delay in us, or UINT64_MAX for the
 * application's own. */
uint64_t bounce_engine_ucx_progress_delay_us(const bounce_engine_t *engine);
/* The fewest descriptors any of BOUNCE's own paths takes between memory of
 * kinds local and remote (UINT64_MAX: none; 0 for a kind BOUNCE does not
 * take): a transfer with fewer goes to the UCX delegate whatever else it
 * is; the shim reads these once. */
uint64_t bounce_engine_route_floor(const bounce_engine_t *engine, bounce_mem_t local, bounce_mem_t remote);
/* Counts a transfer to remote_agent with fewer descriptors than its floor as
 * prepared on the UCX delegate, as the engine counts its own such decisions.
 * 1: counted, prepare it on the delegate; 0: call bounce_engine_prep_xfer
 * (the engine stopped after an internal error, or the name is not UTF-8:
 * it refuses the call in its own words). */
int32_t bounce_engine_count_below_floor(const bounce_engine_t *engine, bounce_bytes_t remote_agent);
/* Records that the UCX delegate could not be created (reason borrowed for the
 * call): the engine logs it once. */
void bounce_engine_report(bounce_engine_t *engine, bounce_bytes_t message);

/* ---- memory ---- */

/* ucx_public: the UCX delegate's public data of the same region. */
bounce_status_t bounce_engine_register_mem(bounce_engine_t *engine,
                                           uintptr_t addr,
                                           size_t len,
                                           uint64_t dev_id,
                                           bounce_mem_t mem,
                                           bounce_bytes_t ucx_public,
                                           bounce_md_t **out);
bounce_status_t bounce_engine_deregister_mem(bounce_engine_t *engine, bounce_md_t *md);
bounce_status_t bounce_engine_public_data(bounce_engine_t *engine,
                                          const bounce_md_t *md,
                                          bounce_sink_t sink,
                                          void *ctx);
/* ucx_conn: the UCX delegate's connection info, carried inside ours. */
bounce_status_t bounce_engine_conn_info(bounce_engine_t *engine,
                                        bounce_bytes_t ucx_conn,
                                        bounce_sink_t sink,
                                        void *ctx);
/* ucx_sink receives the peer's UCX connection info (once, on success). */
bounce_status_t bounce_engine_load_remote_conn_info(bounce_engine_t *engine,
                                                    bounce_bytes_t remote_agent,
                                                    bounce_bytes_t conn_info,
                                                    bounce_sink_t ucx_sink,
                                                    void *ucx_ctx);
/* ucx_sink receives the UCX public data of the region (once, on success). */
bounce_status_t bounce_engine_load_remote_md(bounce_engine_t *engine,
                                             uintptr_t addr,
                                             size_t len,
                                             uint64_t dev_id,
                                             bounce_bytes_t public_data,
                                             bounce_mem_t mem,
                                             bounce_bytes_t remote_agent,
                                             bounce_sink_t ucx_sink,
                                             void *ucx_ctx,
                                             bounce_md_t **out);
bounce_status_t bounce_engine_load_local_md(bounce_engine_t *engine,
                                            const bounce_md_t *input,
                                            bounce_md_t **out);
bounce_status_t bounce_engine_unload_md(bounce_engine_t *engine, bounce_md_t *md);
/* Forgets what preparations keep of the regions they met; called under the
 * shim's table writer lock before a handle leaves the table. */
bounce_status_t bounce_engine_forget_regions(bounce_engine_t *engine);

/* ---- connections ---- */

bounce_status_t bounce_engine_connect(bounce_engine_t *engine, bounce_bytes_t remote_agent);
bounce_status_t bounce_engine_disconnect(bounce_engine_t *engine, bounce_bytes_t remote_agent);

/* ---- transfers ---- */

/* What a preparation can refuse before any descriptor is looked at (the
 * operation, the lists' counts, the remote agent, the custom parameter).
 * On success *defer is 1 when the request's routing and per-descriptor work
 * wait for its first post (setting prepare_at_post): the shim then calls
 * prep_xfer there, with the post's lists, and keeps what it made for the
 * request's re-posts; 0: call prep_xfer now. The lists' memory types (as
 * NIXL numbers them) only tell whether to wake the preparation's threads
 * for the post. */
bounce_status_t bounce_engine_admit_xfer(bounce_engine_t *engine,
                                         bounce_op_t op,
                                         size_t local_count,
                                         size_t remote_count,
                                         bounce_mem_t local_mem,
                                         bounce_mem_t remote_mem,
                                         bounce_bytes_t remote_agent,
                                         const bounce_xfer_args_t *args,
                                         int32_t *defer);
/* *req is NULL on entry to prep_xfer. On success either *delegate is 1 and
 * *req stays NULL (the transfer is the UCX delegate's to prepare and run), or
 * *delegate is 0 and *req holds a new request. */
bounce_status_t bounce_engine_prep_xfer(bounce_engine_t *engine,
                                        bounce_op_t op,
                                        const bounce_desc_list_t *local,
                                        const bounce_desc_list_t *remote,
                                        bounce_bytes_t remote_agent,
                                        const bounce_xfer_args_t *args,
                                        int32_t *delegate,
                                        bounce_req_t **req);
/* Posts (or posts again, once it completed) a request from prep_xfer. */
bounce_status_t bounce_engine_post_xfer(bounce_engine_t *engine,
                                        const bounce_xfer_args_t *args,
                                        bounce_req_t *req);
bounce_status_t bounce_engine_check_xfer(bounce_engine_t *engine, bounce_req_t *req);
bounce_status_t bounce_engine_release_req(bounce_engine_t *engine, bounce_req_t *req);

/* ---- notifications ---- */

/* The notifications of BOUNCE's own paths (the UCX delegate's come from it). */
bounce_status_t bounce_engine_get_notifs(bounce_engine_t *engine, bounce_notif_sink_t sink, void *ctx);

#ifdef __cplusplus
}
#endif

#endif /* NIXL_BOUNCE_FFI_H */
