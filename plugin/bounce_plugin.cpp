// The BOUNCE plugin shim: NIXL's C++ engine interface -> the C calls of
// include/bounce_ffi.h, implemented in Rust (src/ffi/). Translation only: no
// decisions are made here. The one thing it owns besides the translation is
// the UCX delegate: NIXL's own UCX engine, loaded from libplugin_UCX.so and
// called directly for every transfer that the Rust side routes to it, so that
// such a transfer costs what it costs under UCX (docs/design.md §2).
//
// Every entry point from NIXL is noexcept and catches every C++ exception
// (std::bad_alloc from a string copy, say) and turns it into an error status;
// the Rust side catches its own panics. Nothing ever unwinds into NIXL.

#include "bounce_ffi.h"
#include "nixl_abi/nixl_abi.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

// ABI pin: the data members of nixlBackendEngine as NIXL 1.5.1 lays them out
// (vptr, type, params, telemetry queue + mutex, initErr, localAgent, telemetry
// flag). tests/abi.rs checks the same thing against a live agent.
static_assert(sizeof(nixlBackendEngine) == 208, "nixlBackendEngine layout");

namespace {

bounce_bytes_t bytes(const std::string &s) {
    return bounce_bytes_t{reinterpret_cast<const uint8_t *>(s.data()), s.size()};
}

void append_to_string(void *ctx, const uint8_t *ptr, size_t len) {
    static_cast<std::string *>(ctx)->append(reinterpret_cast<const char *>(ptr), len);
}

void append_to_vector(void *ctx, const uint8_t *ptr, size_t len) {
    static_cast<std::vector<std::string> *>(ctx)->emplace_back(reinterpret_cast<const char *>(ptr), len);
}

// Backend parameters from the flat key, value, key, ... list the Rust side
// hands out.
nixl_b_params_t to_params(const std::vector<std::string> &flat) {
    nixl_b_params_t params;
    for (size_t i = 0; i + 1 < flat.size(); i += 2) {
        params.emplace(flat[i], flat[i + 1]);
    }
    return params;
}

void assign_string(void *ctx, const uint8_t *ptr, size_t len) {
    static_cast<std::string *>(ctx)->assign(reinterpret_cast<const char *>(ptr), len);
}

void append_notif(void *ctx, bounce_bytes_t agent, bounce_bytes_t msg) {
    static_cast<notif_list_t *>(ctx)->emplace_back(
        std::string(reinterpret_cast<const char *>(agent.ptr), agent.len),
        std::string(reinterpret_cast<const char *>(msg.ptr), msg.len));
}

// Runs f, turning any C++ exception into an error status.
template <class F> nixl_status_t guarded(const char *what, F &&f) noexcept {
    try {
        return static_cast<nixl_status_t>(f());
    } catch (const std::exception &e) {
        std::fprintf(stderr, "nixl-bounce: %s failed: %s\n", what, e.what());
    } catch (...) {
        std::fprintf(stderr, "nixl-bounce: %s failed: unknown C++ exception\n", what);
    }
    return NIXL_ERR_BACKEND;
}

// BOUNCE's metadata of the regions an engine registered or loaded, under
// the handle NIXL holds for each: the UCX delegate's own metadata object of
// the region. NIXL's descriptor lists are then UCX's as they stand, and the
// UCX route passes them on untouched, with no copy per descriptor. `loaded`
// tells which calls release an entry's parts.
struct MdEntry {
    bounce_md_t *md;
    bool loaded;
};
using md_table_t = std::unordered_map<const nixlBackendMD *, MdEntry>;

// The engine's resolver (bounce_md_resolver_t): ctx is the engine's table,
// whose reader lock route() holds for the engine's whole preparation (the
// engine may call this from several threads then; none of them locks).
const bounce_md_t *resolve_md(const void *ctx, const void *md) {
    const auto &table = *static_cast<const md_table_t *>(ctx);
    const auto it = table.find(static_cast<const nixlBackendMD *>(md));
    return it == table.end() ? nullptr : it->second.md;
}

// NIXL-owned request handle: a Rust bounce_req_t (owned), or a request of
// the UCX delegate (owned), prepared and posted with NIXL's own lists; or
// neither yet, while its routing waits for its first post
// (bounce_engine_admit_xfer).
class BounceReqH final : public nixlBackendReqH {
public:
    bool routed() const { return req || ucx; }
    bounce_req_t *req = nullptr;
    // Set by the delegate's prepXfer.
    nixlBackendReqH *ucx = nullptr;
    // The custom parameter prepXfer was given, for the routing at the
    // first post (NIXL's createXferReq passes it to prepXfer, never to
    // postXfer; makeXferReq passes none).
    nixl_blob_t custom;
};

// NIXL's UCX engine, created from the UCX plugin installed beside this one.
class UcxDelegate {
public:
    // Loads libplugin_UCX.so from this plugin's own folder (where NIXL's
    // wheel keeps it; README "setup") or else from NIXL_PLUGIN_DIR, and
    // creates an engine with the application's init parameters and the UCX
    // subset of its backend parameters. nullptr with `error` set on failure.
    static std::unique_ptr<UcxDelegate>
    create(const nixlBackendInitParams *init,
           nixl_b_params_t ucx_params,
           uint64_t progress_delay_us,
           std::string &error) {
        const std::string path = plugin_path();
        void *lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            const char *why = dlerror();
            error = "cannot load NIXL's UCX plugin " + path + " (" + (why ? why : "unknown error") +
                "); BOUNCE needs it beside libplugin_BOUNCE.so";
            return nullptr;
        }
        using init_fn = nixlBackendPlugin *(*)();
        auto plugin_init = reinterpret_cast<init_fn>(dlsym(lib, "nixl_plugin_init"));
        nixlBackendPlugin *plugin = plugin_init ? plugin_init() : nullptr;
        if (!plugin || plugin->api_version != NIXL_PLUGIN_API_VERSION || !plugin->create_engine ||
            !plugin->destroy_engine) {
            error = path + " is not a NIXL plugin of API version " + std::to_string(NIXL_PLUGIN_API_VERSION);
            dlclose(lib);
            return nullptr;
        }
        nixlBackendInitParams ucx_init;
        ucx_init.localAgent = init->localAgent;
        ucx_init.type = "UCX";
        ucx_init.customParams = &ucx_params;
        ucx_init.enableProgTh = init->enableProgTh;
        ucx_init.pthrDelay = progress_delay_us == UINT64_MAX ? init->pthrDelay : progress_delay_us;
        ucx_init.syncMode = init->syncMode;
        ucx_init.enableTelemetry_ = init->enableTelemetry_;
        nixlBackendEngine *engine = plugin->create_engine(&ucx_init);
        if (!engine || engine->getInitErr()) {
            std::string given;
            for (const auto &[k, v] : ucx_params) {
                given += (given.empty() ? "" : ", ") + k + "=\"" + v + "\"";
            }
            error = "NIXL's UCX engine (" + path + ") failed to initialise with the parameters {" + given +
                "}; check their values";
            if (engine) {
                plugin->destroy_engine(engine);
            }
            dlclose(lib);
            return nullptr;
        }
        return std::unique_ptr<UcxDelegate>(new UcxDelegate(plugin, engine));
    }

    ~UcxDelegate() {
        plugin_->destroy_engine(engine);
        // The library stays loaded: UCX keeps process-wide state (its memory
        // hooks among it) that must not be unmapped under the application.
    }

    nixlBackendEngine *const engine;

private:
    UcxDelegate(nixlBackendPlugin *plugin, nixlBackendEngine *engine) : engine(engine), plugin_(plugin) {}

    static std::string plugin_path() {
        Dl_info info{};
        if (dladdr(reinterpret_cast<void *>(&plugin_path), &info) != 0 && info.dli_fname) {
            std::string self = info.dli_fname;
            const size_t slash = self.rfind('/');
            if (slash != std::string::npos) {
                std::string beside = self.substr(0, slash + 1) + "libplugin_UCX.so";
                if (access(beside.c_str(), R_OK) == 0) {
                    return beside;
                }
            }
        }
        if (const char *dir = std::getenv("NIXL_PLUGIN_DIR"); dir && *dir) {
            return std::string(dir) + "/libplugin_UCX.so";
        }
        return "libplugin_UCX.so";
    }

    nixlBackendPlugin *plugin_;
};

// The C boundary's codes are NIXL's own: the shim casts statuses, memory
// types and operations across unchanged (the Rust side ties its enums to the
// same header constants, engine::Status, MemKind, Op). NIXL's side here is
// the project's declaration of NIXL's ABI (include/nixl_abi/nixl_abi.h),
// the one the shim is compiled against.
static_assert(BOUNCE_IN_PROG == NIXL_IN_PROG && BOUNCE_SUCCESS == NIXL_SUCCESS &&
                  BOUNCE_ERR_NOT_POSTED == NIXL_ERR_NOT_POSTED &&
                  BOUNCE_ERR_INVALID_PARAM == NIXL_ERR_INVALID_PARAM &&
                  BOUNCE_ERR_BACKEND == NIXL_ERR_BACKEND && BOUNCE_ERR_NOT_FOUND == NIXL_ERR_NOT_FOUND &&
                  BOUNCE_ERR_MISMATCH == NIXL_ERR_MISMATCH &&
                  BOUNCE_ERR_NOT_ALLOWED == NIXL_ERR_NOT_ALLOWED &&
                  BOUNCE_ERR_REPOST_ACTIVE == NIXL_ERR_REPOST_ACTIVE &&
                  BOUNCE_ERR_UNKNOWN == NIXL_ERR_UNKNOWN &&
                  BOUNCE_ERR_NOT_SUPPORTED == NIXL_ERR_NOT_SUPPORTED &&
                  BOUNCE_ERR_REMOTE_DISCONNECT == NIXL_ERR_REMOTE_DISCONNECT &&
                  BOUNCE_ERR_CANCELED == NIXL_ERR_CANCELED,
              "bounce_status_t is nixl_status_t");
static_assert(BOUNCE_MEM_DRAM == DRAM_SEG && BOUNCE_MEM_VRAM == VRAM_SEG && BOUNCE_MEM_BLK == BLK_SEG &&
                  BOUNCE_MEM_OBJ == OBJ_SEG && BOUNCE_MEM_FILE == FILE_SEG,
              "bounce_mem_t is nixl_mem_t");
static_assert(BOUNCE_OP_READ == NIXL_READ && BOUNCE_OP_WRITE == NIXL_WRITE, "bounce_op_t is nixl_xfer_op_t");

// NIXL's descriptor array as the C boundary's (bounce_desc_t has nixlMetaDesc's
// layout): passed in place, no copy per descriptor.
static_assert(sizeof(bounce_desc_t) == sizeof(nixlMetaDesc), "bounce_desc_t is nixlMetaDesc");
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
static_assert(offsetof(nixlMetaDesc, addr) == offsetof(bounce_desc_t, addr) &&
                  offsetof(nixlMetaDesc, len) == offsetof(bounce_desc_t, len) &&
                  offsetof(nixlMetaDesc, devId) == offsetof(bounce_desc_t, dev_id) &&
                  offsetof(nixlMetaDesc, metadataP) == offsetof(bounce_desc_t, md),
              "bounce_desc_t is nixlMetaDesc");
#pragma GCC diagnostic pop

bounce_desc_list_t desc_list(const nixl_meta_dlist_t &list, const md_table_t &mds) {
    const size_t n = static_cast<size_t>(list.descCount());
    return bounce_desc_list_t{n ? reinterpret_cast<const bounce_desc_t *>(&list[0]) : nullptr, n,
                              static_cast<bounce_mem_t>(list.getType()), resolve_md, &mds};
}

bounce_xfer_args_t xfer_args(const nixl_opt_b_args_t *opt) {
    if (!opt) {
        return bounce_xfer_args_t{0, {nullptr, 0}, {nullptr, 0}};
    }
    return bounce_xfer_args_t{opt->hasNotif ? 1 : 0, bytes(opt->notifMsg), bytes(opt->customParam)};
}

class BounceEngine final : public nixlBackendEngine {
public:
    explicit BounceEngine(const nixlBackendInitParams *init) : nixlBackendEngine(init) {
        std::vector<bounce_param_t> params;
        if (init->customParams) {
            params.reserve(init->customParams->size());
            for (const auto &kv : *init->customParams) {
                params.push_back(bounce_param_t{bytes(kv.first), bytes(kv.second)});
            }
        }
        std::string error;
        const bounce_status_t st = bounce_engine_new(
            bytes(init->localAgent), params.data(), params.size(), append_to_string, &error, &engine);
        if (st != BOUNCE_SUCCESS || engine == nullptr) {
            // NIXL reports this as "backend initialization error"; the reason
            // was logged by the Rust side.
            initErr = true;
            engine = nullptr;
            return;
        }
        std::vector<std::string> flat;
        if (bounce_engine_ucx_params(engine, append_to_vector, &flat) != BOUNCE_SUCCESS) {
            initErr = true;
            return;
        }
        ucx = UcxDelegate::create(init, to_params(flat), bounce_engine_ucx_progress_delay_us(engine), error);
        if (!ucx) {
            bounce_engine_report(engine, bytes(error));
            initErr = true;
        }
        for (int l = 0; l < 2; ++l) {
            for (int r = 0; r < 2; ++r) {
                floor_[l][r] = bounce_engine_route_floor(engine, l, r);
            }
        }
    }

    ~BounceEngine() override {
        // The Rust engine first: its threads may still send through its own
        // inner agent, never through the delegate.
        if (engine) {
            bounce_engine_free(engine);
        }
        ucx.reset();
    }

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    nixl_mem_list_t getSupportedMems() const override { return {DRAM_SEG, VRAM_SEG}; }

    nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &kind, nixlBackendMD *&out) override {
        return guarded("registerMem", [&] {
            if (!ucx) {
                return NIXL_ERR_BACKEND;
            }
            nixlBackendMD *u = nullptr;
            nixl_status_t st = ucx->engine->registerMem(mem, kind, u);
            if (st != NIXL_SUCCESS) {
                return st;
            }
            std::string pub;
            st = ucx->engine->getPublicData(u, pub);
            bounce_md_t *md = nullptr;
            if (st == NIXL_SUCCESS) {
                st = static_cast<nixl_status_t>(bounce_engine_register_mem(
                    engine, mem.addr, mem.len, mem.devId, static_cast<bounce_mem_t>(kind), bytes(pub), &md));
            }
            if (st != NIXL_SUCCESS) {
                ucx->engine->deregisterMem(u);
                return st;
            }
            return keep(md, u, false, out);
        });
    }

    nixl_status_t deregisterMem(nixlBackendMD *meta) override {
        return guarded("deregisterMem", [&] { return release_md(meta, false); });
    }

    nixl_status_t unloadMD(nixlBackendMD *input) override {
        return guarded("unloadMD", [&] { return release_md(input, true); });
    }

    nixl_status_t connect(const std::string &remote_agent) override {
        return guarded("connect", [&] {
            if (!ucx) {
                return NIXL_ERR_BACKEND;
            }
            const nixl_status_t st = ucx->engine->connect(remote_agent);
            if (st != NIXL_SUCCESS) {
                return st;
            }
            return static_cast<nixl_status_t>(bounce_engine_connect(engine, bytes(remote_agent)));
        });
    }

    nixl_status_t disconnect(const std::string &remote_agent) override {
        return guarded("disconnect", [&] {
            const bounce_status_t own = bounce_engine_disconnect(engine, bytes(remote_agent));
            const nixl_status_t st = ucx ? ucx->engine->disconnect(remote_agent) : NIXL_SUCCESS;
            return own != BOUNCE_SUCCESS ? static_cast<nixl_status_t>(own) : st;
        });
    }

    nixl_status_t prepXfer(const nixl_xfer_op_t &op,
                           const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote,
                           const std::string &remote_agent,
                           nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *opt_args) const override {
        return guarded("prepXfer", [&] {
            if (!ucx) {
                return NIXL_ERR_BACKEND;
            }
            auto h = std::make_unique<BounceReqH>();
            // Too few descriptors for any of BOUNCE's paths (the engine's
            // rule, read once): the commonest UCX-routed transfers skip the
            // engine's preparation, which only counts them.
            const bool ucx_route =
                below_floor(local, remote, opt_args) &&
                bounce_engine_count_below_floor(engine, bytes(remote_agent)) == 1;
            if (!ucx_route) {
                // What needs no descriptor is refused here; the rest waits
                // for the first post when the engine says so.
                const bounce_xfer_args_t args = xfer_args(opt_args);
                int32_t defer = 0;
                const bounce_status_t st =
                    bounce_engine_admit_xfer(engine, static_cast<bounce_op_t>(op), local.descCount(),
                                             remote.descCount(), local.getType(), remote.getType(),
                                             bytes(remote_agent), &args, &defer);
                if (st != BOUNCE_SUCCESS) {
                    return static_cast<nixl_status_t>(st);
                }
                if (defer) {
                    if (opt_args) {
                        h->custom = opt_args->customParam;
                    }
                    handle = h.release();
                    return NIXL_SUCCESS;
                }
            }
            const nixl_status_t st = route(op, local, remote, remote_agent, opt_args, !ucx_route, *h);
            if (st == NIXL_SUCCESS) {
                handle = h.release();
            }
            return st;
        });
    }

    // Prepares a request on its route: with `ask_engine`, the engine checks
    // the descriptors and prepares it on one of BOUNCE's paths (h.req) or
    // hands it to the delegate; otherwise, or then, the delegate prepares it
    // (h.ucx). On failure h is left as it was.
    nixl_status_t route(const nixl_xfer_op_t &op,
                        const nixl_meta_dlist_t &local,
                        const nixl_meta_dlist_t &remote,
                        const std::string &remote_agent,
                        const nixl_opt_b_args_t *opt_args,
                        bool ask_engine,
                        BounceReqH &h) const {
        if (ask_engine) {
            // The engine resolves the descriptors' metadata in the table
            // while it runs: no registration may change it meanwhile.
            std::shared_lock lock(mds_lock_);
            const bounce_desc_list_t l = desc_list(local, mds_), r = desc_list(remote, mds_);
            const bounce_xfer_args_t args = xfer_args(opt_args);
            int32_t delegate = 0;
            bounce_req_t *req = nullptr;
            const bounce_status_t st = bounce_engine_prep_xfer(
                engine, static_cast<bounce_op_t>(op), &l, &r, bytes(remote_agent), &args, &delegate, &req);
            if (st != BOUNCE_SUCCESS) {
                return static_cast<nixl_status_t>(st);
            }
            if (!delegate) {
                h.req = req;
                return NIXL_SUCCESS;
            }
        }
        nixlBackendReqH *u = nullptr;
        const auto release_delegate = [&] {
            if (u) {
                ucx->engine->releaseReqH(u);
            }
        };
        nixl_status_t ust;
        try {
            ust = ucx->engine->prepXfer(op, local, remote, remote_agent, u, opt_args);
        } catch (...) {
            release_delegate();
            throw;
        }
        if (ust != NIXL_SUCCESS || !u) {
            release_delegate();
            // A success without a request would be posted as BOUNCE's own.
            return ust != NIXL_SUCCESS ? ust : NIXL_ERR_BACKEND;
        }
        h.ucx = u;
        return NIXL_SUCCESS;
    }

    // Fewer descriptors than any of BOUNCE's paths takes between these
    // kinds (bounce_engine_route_floor), as many on both sides, and no
    // custom parameter (the engine words the errors about those, whichever
    // path a transfer would take).
    bool below_floor(const nixl_meta_dlist_t &local,
                     const nixl_meta_dlist_t &remote,
                     const nixl_opt_b_args_t *opt_args) const {
        const int l = local.getType(), r = remote.getType();
        if (l < 0 || l > 1 || r < 0 || r > 1 || (opt_args && !opt_args->customParam.empty())) {
            return false;
        }
        return local.descCount() == remote.descCount() &&
            static_cast<uint64_t>(local.descCount()) < floor_[l][r];
    }

    nixl_status_t postXfer(const nixl_xfer_op_t &op,
                           const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote,
                           const std::string &remote_agent,
                           nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *opt_args) const override {
        return guarded("postXfer", [&] {
            const bool bare = !handle;
            if (bare) {
                // NIXL always prepares first; a bare post is prepared here.
                const nixl_status_t st = prepXfer(op, local, remote, remote_agent, handle, opt_args);
                if (st != NIXL_SUCCESS) {
                    return st;
                }
            }
            auto *h = static_cast<BounceReqH *>(handle);
            if (!h->routed()) {
                // The first post of a request whose preparation waited for
                // it: routed and prepared now, with NIXL's lists and the
                // custom parameter prepXfer had, once.
                nixl_opt_b_args_t args = opt_args ? *opt_args : nixl_opt_b_args_t{};
                if (args.customParam.empty()) {
                    args.customParam = h->custom;
                }
                const nixl_status_t st = route(op, local, remote, remote_agent, &args, true, *h);
                if (st != NIXL_SUCCESS) {
                    if (bare) {
                        // A failed bare post leaves no handle, as before.
                        delete h;
                        handle = nullptr;
                    }
                    return st;
                }
            }
            if (h->ucx) {
                return ucx->engine->postXfer(op, local, remote, remote_agent, h->ucx, opt_args);
            }
            const bounce_xfer_args_t args = xfer_args(opt_args);
            return static_cast<nixl_status_t>(bounce_engine_post_xfer(engine, &args, h->req));
        });
    }

    nixl_status_t checkXfer(nixlBackendReqH *handle) const override {
        return guarded("checkXfer", [&] {
            if (!handle) {
                return NIXL_ERR_INVALID_PARAM;
            }
            auto *h = static_cast<BounceReqH *>(handle);
            if (!h->routed()) {
                return NIXL_ERR_NOT_POSTED;
            }
            return h->ucx ? ucx->engine->checkXfer(h->ucx)
                          : static_cast<nixl_status_t>(bounce_engine_check_xfer(engine, h->req));
        });
    }

    nixl_status_t releaseReqH(nixlBackendReqH *handle) const override {
        return guarded("releaseReqH", [&] {
            if (!handle) {
                return NIXL_ERR_INVALID_PARAM;
            }
            auto *h = static_cast<BounceReqH *>(handle);
            // On an error NIXL keeps the handle and may release it again:
            // it must stay valid then.
            if (h->ucx) {
                const nixl_status_t st = ucx->engine->releaseReqH(h->ucx);
                if (st != NIXL_SUCCESS) {
                    // The delegate keeps its request.
                    return st;
                }
            } else if (h->req) {
                // The engine frees its request whatever it answers.
                const nixl_status_t st = static_cast<nixl_status_t>(bounce_engine_release_req(engine, h->req));
                h->req = nullptr;
                if (st != NIXL_SUCCESS) {
                    return st;
                }
            }
            delete h;
            return NIXL_SUCCESS;
        });
    }

    nixl_status_t getPublicData(const nixlBackendMD *meta, std::string &str) const override {
        return guarded("getPublicData", [&] {
            str.clear();
            std::shared_lock lock(mds_lock_);
            return bounce_engine_public_data(engine, bounce_md(meta), append_to_string, &str);
        });
    }

    nixl_status_t getConnInfo(std::string &str) const override {
        return guarded("getConnInfo", [&] {
            if (!ucx) {
                return NIXL_ERR_BACKEND;
            }
            std::string ucx_conn;
            const nixl_status_t st = ucx->engine->getConnInfo(ucx_conn);
            if (st != NIXL_SUCCESS) {
                return st;
            }
            str.clear();
            return static_cast<nixl_status_t>(
                bounce_engine_conn_info(engine, bytes(ucx_conn), append_to_string, &str));
        });
    }

    nixl_status_t loadRemoteConnInfo(const std::string &remote_agent, const std::string &info) override {
        return guarded("loadRemoteConnInfo", [&] {
            if (!ucx) {
                return NIXL_ERR_BACKEND;
            }
            std::string ucx_conn;
            const bounce_status_t st = bounce_engine_load_remote_conn_info(
                engine, bytes(remote_agent), bytes(info), assign_string, &ucx_conn);
            if (st != BOUNCE_SUCCESS) {
                return static_cast<nixl_status_t>(st);
            }
            // The newest connection info wins, as on BOUNCE's own side: NIXL
            // keeps a peer's connection from metadata that then failed to
            // load, and UCX alone would refuse the real one afterwards
            // (tests/bad_input.rs). Requests and regions already made hold
            // their connection themselves.
            ucx->engine->disconnect(remote_agent);
            const nixl_status_t ust = ucx->engine->loadRemoteConnInfo(remote_agent, ucx_conn);
            if (ust != NIXL_SUCCESS) {
                bounce_engine_disconnect(engine, bytes(remote_agent));
            }
            return ust;
        });
    }

    nixl_status_t loadRemoteMD(const nixlBlobDesc &input,
                               const nixl_mem_t &kind,
                               const std::string &remote_agent,
                               nixlBackendMD *&out) override {
        return guarded("loadRemoteMD", [&] {
            if (!ucx) {
                return NIXL_ERR_BACKEND;
            }
            nixlBlobDesc ucx_input;
            static_cast<nixlBasicDesc &>(ucx_input) = input;
            bounce_md_t *md = nullptr;
            const bounce_status_t st = bounce_engine_load_remote_md(
                engine, input.addr, input.len, input.devId, bytes(input.metaInfo), static_cast<bounce_mem_t>(kind),
                bytes(remote_agent), assign_string, &ucx_input.metaInfo, &md);
            if (st != BOUNCE_SUCCESS) {
                return static_cast<nixl_status_t>(st);
            }
            nixlBackendMD *u = nullptr;
            const nixl_status_t ust = ucx->engine->loadRemoteMD(ucx_input, kind, remote_agent, u);
            if (ust != NIXL_SUCCESS) {
                bounce_engine_unload_md(engine, md);
                return ust;
            }
            return keep(md, u, true, out);
        });
    }

    nixl_status_t loadLocalMD(nixlBackendMD *input, nixlBackendMD *&out) override {
        return guarded("loadLocalMD", [&] {
            if (!ucx) {
                return NIXL_ERR_BACKEND;
            }
            bounce_md_t *md = nullptr;
            bounce_status_t st;
            {
                std::shared_lock lock(mds_lock_);
                st = bounce_engine_load_local_md(engine, bounce_md(input), &md);
            }
            if (st != BOUNCE_SUCCESS) {
                return static_cast<nixl_status_t>(st);
            }
            nixlBackendMD *u = nullptr;
            const nixl_status_t ust = ucx->engine->loadLocalMD(input, u);
            if (ust != NIXL_SUCCESS) {
                bounce_engine_unload_md(engine, md);
                return ust;
            }
            return keep(md, u, true, out);
        });
    }

    nixl_status_t getNotifs(notif_list_t &notif_list) override {
        return guarded("getNotifs", [&] {
            if (ucx) {
                const nixl_status_t st = ucx->engine->getNotifs(notif_list);
                if (st != NIXL_SUCCESS) {
                    return st;
                }
            }
            return static_cast<nixl_status_t>(bounce_engine_get_notifs(engine, append_notif, &notif_list));
        });
    }

    nixl_status_t genNotif(const std::string &remote_agent, const std::string &msg) const override {
        return guarded("genNotif", [&] { return ucx ? ucx->engine->genNotif(remote_agent, msg) : NIXL_ERR_BACKEND; });
    }

private:
    // Keeps a Rust handle under the delegate's metadata of the same memory,
    // which becomes NIXL's handle (`out`); releases both again if the table
    // cannot hold it, so nothing leaks on bad_alloc.
    nixl_status_t keep(bounce_md_t *md, nixlBackendMD *u, bool loaded, nixlBackendMD *&out) {
        if (!u) {
            // A success without a handle: nothing could find this region.
            std::fprintf(stderr, "nixl-bounce: NIXL's UCX engine returned no metadata handle\n");
            release_parts(md, nullptr, loaded);
            return NIXL_ERR_BACKEND;
        }
        bool kept = false;
        try {
            std::unique_lock lock(mds_lock_);
            kept = mds_.emplace(u, MdEntry{md, loaded}).second;
        } catch (...) {
            release_parts(md, u, loaded);
            throw;
        }
        if (!kept) {
            // The delegate handed out a handle that is still in use: it is
            // the live entry's, so only BOUNCE's part of this one goes.
            std::fprintf(stderr, "nixl-bounce: NIXL's UCX engine returned a metadata handle already in use\n");
            release_parts(md, nullptr, loaded);
            return NIXL_ERR_BACKEND;
        }
        out = u;
        return NIXL_SUCCESS;
    }

    // BOUNCE's metadata under a handle NIXL holds (nullptr: not this
    // engine's). Needs mds_lock_.
    const bounce_md_t *bounce_md(const nixlBackendMD *meta) const {
        return meta ? resolve_md(&mds_, meta) : nullptr;
    }

    // The Rust side first: deregistration waits there until no copy of
    // BOUNCE's own paths touches the memory.
    nixl_status_t release_parts(bounce_md_t *md, nixlBackendMD *u, bool loaded) {
        const bounce_status_t st =
            loaded ? bounce_engine_unload_md(engine, md) : bounce_engine_deregister_mem(engine, md);
        nixl_status_t ust = NIXL_SUCCESS;
        if (u && ucx) {
            ust = loaded ? ucx->engine->unloadMD(u) : ucx->engine->deregisterMem(u);
        }
        return st != BOUNCE_SUCCESS ? static_cast<nixl_status_t>(st) : ust;
    }

    // Deregisters (`loaded` false) or unloads a handle NIXL holds: out of
    // the table first, so that no preparation finds it any more.
    nixl_status_t release_md(nixlBackendMD *meta, bool loaded) {
        MdEntry entry{};
        {
            std::unique_lock lock(mds_lock_);
            const auto it = mds_.find(meta);
            if (!meta || it == mds_.end() || it->second.loaded != loaded) {
                return NIXL_ERR_INVALID_PARAM;
            }
            entry = it->second;
            // No preparation runs now (they hold the reader lock): none may
            // find this region among those the engine kept from the last
            // one, from here on. (It fails only without an engine, which
            // keeps nothing.)
            (void)bounce_engine_forget_regions(engine);
            mds_.erase(it);
        }
        return release_parts(entry.md, meta, entry.loaded);
    }

    bounce_engine_t *engine = nullptr;
    std::unique_ptr<UcxDelegate> ucx;
    // Changed under the writer lock; read under the reader lock.
    mutable std::shared_mutex mds_lock_;
    md_table_t mds_;
    // bounce_engine_route_floor per (local, remote) kind, DRAM and VRAM;
    // 0 (nothing is below it) until read.
    uint64_t floor_[2][2] = {{0, 0}, {0, 0}};
};

nixlBackendEngine *create_engine(const nixlBackendInitParams *init) noexcept {
    try {
        return new BounceEngine(init);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "nixl-bounce: engine creation failed: %s\n", e.what());
    } catch (...) {
        std::fprintf(stderr, "nixl-bounce: engine creation failed: unknown C++ exception\n");
    }
    return nullptr;
}

void destroy_engine(nixlBackendEngine *engine) noexcept {
    delete engine;
}

const char *plugin_name() noexcept {
    return "BOUNCE";
}

const char *plugin_version() noexcept {
    return bounce_plugin_version();
}

nixl_b_params_t backend_options() noexcept {
    try {
        std::vector<std::string> flat;
        if (bounce_plugin_options(append_to_vector, &flat) != BOUNCE_SUCCESS) {
            return {};
        }
        return to_params(flat);
    } catch (...) {
        return {};
    }
}

nixl_mem_list_t backend_mems() noexcept {
    try {
        return {DRAM_SEG, VRAM_SEG};
    } catch (...) {
        return {};
    }
}

nixlBackendPlugin plugin = {
    NIXL_PLUGIN_API_VERSION, create_engine, destroy_engine, plugin_name, plugin_version, backend_options, backend_mems,
};

} // namespace

// Called by the Rust-exported nixl_plugin_init (rustc's cdylib export list
// only carries Rust items, so the entry points are declared in src/ffi/).
extern "C" void *bounce_shim_plugin(void) {
    return &plugin;
}
