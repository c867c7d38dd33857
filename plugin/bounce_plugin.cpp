// The BOUNCE plugin shim: NIXL's C++ engine interface -> the C calls of
// include/bounce_ffi.h, implemented in Rust (src/ffi/). Translation only: no
// decisions are made here.
//
// Every entry point from NIXL is noexcept and catches every C++ exception
// (std::bad_alloc from a string copy, say) and turns it into an error status;
// the Rust side catches its own panics. Nothing ever unwinds into NIXL.

#include "bounce_ffi.h"
#include "nixl_abi/nixl_abi.h"

#include <cstdio>
#include <exception>
#include <new>
#include <string>
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

// NIXL-owned metadata object wrapping a Rust bounce_md_t (owned, see
// bounce_ffi.h). `loaded` tells which Rust call releases it.
class BounceMD final : public nixlBackendMD {
public:
    BounceMD(bounce_md_t *md, bool loaded) : nixlBackendMD(!loaded), md(md), loaded(loaded) {}
    bounce_md_t *const md;
    const bool loaded;
};

// NIXL-owned request handle wrapping a Rust bounce_req_t (owned).
class BounceReqH final : public nixlBackendReqH {
public:
    explicit BounceReqH(bounce_req_t *req) : req(req) {}
    bounce_req_t *const req;
};

const bounce_md_t *rust_md(const nixlBackendMD *md) {
    return md ? static_cast<const BounceMD *>(md)->md : nullptr;
}

// Flattens a NIXL descriptor list into a C array for one call.
class DescList {
public:
    explicit DescList(const nixl_meta_dlist_t &list) {
        descs.reserve(static_cast<size_t>(list.descCount()));
        for (int i = 0; i < list.descCount(); ++i) {
            const nixlMetaDesc &d = list[static_cast<size_t>(i)];
            descs.push_back(bounce_desc_t{d.addr, d.len, d.devId, rust_md(d.metadataP)});
        }
        c = bounce_desc_list_t{descs.data(), descs.size(), static_cast<bounce_mem_t>(list.getType())};
    }
    const bounce_desc_list_t *get() const { return &c; }

private:
    std::vector<bounce_desc_t> descs;
    bounce_desc_list_t c;
};

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
            // was logged by the Rust side, and is kept here for the destructor.
            initErr = true;
            engine = nullptr;
        }
    }

    ~BounceEngine() override {
        if (engine) {
            bounce_engine_free(engine);
        }
    }

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    nixl_mem_list_t getSupportedMems() const override { return {DRAM_SEG, VRAM_SEG}; }

    nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &kind, nixlBackendMD *&out) override {
        return guarded("registerMem", [&] {
            bounce_md_t *md = nullptr;
            const bounce_status_t st = bounce_engine_register_mem(
                engine, mem.addr, mem.len, mem.devId, static_cast<bounce_mem_t>(kind), &md);
            if (st == BOUNCE_SUCCESS) {
                out = wrap_md(md, false);
            }
            return st;
        });
    }

    nixl_status_t deregisterMem(nixlBackendMD *meta) override {
        return guarded("deregisterMem", [&] { return release_md(meta); });
    }

    nixl_status_t unloadMD(nixlBackendMD *input) override {
        return guarded("unloadMD", [&] { return release_md(input); });
    }

    nixl_status_t connect(const std::string &remote_agent) override {
        return guarded("connect", [&] { return bounce_engine_connect(engine, bytes(remote_agent)); });
    }

    nixl_status_t disconnect(const std::string &remote_agent) override {
        return guarded("disconnect", [&] { return bounce_engine_disconnect(engine, bytes(remote_agent)); });
    }

    nixl_status_t prepXfer(const nixl_xfer_op_t &op,
                           const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote,
                           const std::string &remote_agent,
                           nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *opt_args) const override {
        return guarded("prepXfer", [&] {
            const DescList l(local), r(remote);
            const bounce_xfer_args_t args = xfer_args(opt_args);
            bounce_req_t *req = nullptr;
            const bounce_status_t st = bounce_engine_prep_xfer(
                engine, static_cast<bounce_op_t>(op), l.get(), r.get(), bytes(remote_agent), &args, &req);
            if (st == BOUNCE_SUCCESS) {
                handle = wrap_req(req);
            }
            return st;
        });
    }

    nixl_status_t postXfer(const nixl_xfer_op_t &op,
                           const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote,
                           const std::string &remote_agent,
                           nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *opt_args) const override {
        return guarded("postXfer", [&] {
            const DescList l(local), r(remote);
            const bounce_xfer_args_t args = xfer_args(opt_args);
            bounce_req_t *req = handle ? static_cast<BounceReqH *>(handle)->req : nullptr;
            const bool fresh = (req == nullptr);
            const bounce_status_t st = bounce_engine_post_xfer(
                engine, static_cast<bounce_op_t>(op), l.get(), r.get(), bytes(remote_agent), &args, &req);
            if (fresh && req != nullptr) {
                handle = wrap_req(req);
            }
            return st;
        });
    }

    nixl_status_t checkXfer(nixlBackendReqH *handle) const override {
        return guarded("checkXfer", [&] {
            return handle ? bounce_engine_check_xfer(engine, static_cast<BounceReqH *>(handle)->req)
                          : BOUNCE_ERR_INVALID_PARAM;
        });
    }

    nixl_status_t releaseReqH(nixlBackendReqH *handle) const override {
        return guarded("releaseReqH", [&] {
            if (!handle) {
                return BOUNCE_ERR_INVALID_PARAM;
            }
            auto *h = static_cast<BounceReqH *>(handle);
            const bounce_status_t st = bounce_engine_release_req(engine, h->req);
            delete h;
            return st;
        });
    }

    nixl_status_t getPublicData(const nixlBackendMD *meta, std::string &str) const override {
        return guarded("getPublicData", [&] {
            str.clear();
            return bounce_engine_public_data(engine, rust_md(meta), append_to_string, &str);
        });
    }

    nixl_status_t getConnInfo(std::string &str) const override {
        return guarded("getConnInfo", [&] {
            str.clear();
            return bounce_engine_conn_info(engine, append_to_string, &str);
        });
    }

    nixl_status_t loadRemoteConnInfo(const std::string &remote_agent, const std::string &info) override {
        return guarded("loadRemoteConnInfo", [&] {
            return bounce_engine_load_remote_conn_info(engine, bytes(remote_agent), bytes(info));
        });
    }

    nixl_status_t loadRemoteMD(const nixlBlobDesc &input,
                               const nixl_mem_t &kind,
                               const std::string &remote_agent,
                               nixlBackendMD *&out) override {
        return guarded("loadRemoteMD", [&] {
            bounce_md_t *md = nullptr;
            const bounce_status_t st = bounce_engine_load_remote_md(engine, input.addr, input.len, input.devId,
                                                                    bytes(input.metaInfo),
                                                                    static_cast<bounce_mem_t>(kind),
                                                                    bytes(remote_agent), &md);
            if (st == BOUNCE_SUCCESS) {
                out = wrap_md(md, true);
            }
            return st;
        });
    }

    nixl_status_t loadLocalMD(nixlBackendMD *input, nixlBackendMD *&out) override {
        return guarded("loadLocalMD", [&] {
            bounce_md_t *md = nullptr;
            const bounce_status_t st = bounce_engine_load_local_md(engine, rust_md(input), &md);
            if (st == BOUNCE_SUCCESS) {
                out = wrap_md(md, true);
            }
            return st;
        });
    }

    nixl_status_t getNotifs(notif_list_t &notif_list) override {
        return guarded("getNotifs", [&] { return bounce_engine_get_notifs(engine, append_notif, &notif_list); });
    }

    nixl_status_t genNotif(const std::string &remote_agent, const std::string &msg) const override {
        return guarded("genNotif", [&] { return bounce_engine_gen_notif(engine, bytes(remote_agent), bytes(msg)); });
    }

private:
    // Takes ownership of a Rust handle; frees it again if the wrapper cannot
    // be allocated, so nothing leaks on bad_alloc.
    BounceMD *wrap_md(bounce_md_t *md, bool loaded) {
        try {
            return new BounceMD(md, loaded);
        } catch (...) {
            loaded ? bounce_engine_unload_md(engine, md) : bounce_engine_deregister_mem(engine, md);
            throw;
        }
    }

    BounceReqH *wrap_req(bounce_req_t *req) const {
        try {
            return new BounceReqH(req);
        } catch (...) {
            bounce_engine_release_req(engine, req);
            throw;
        }
    }

    bounce_status_t release_md(nixlBackendMD *meta) {
        if (!meta) {
            return BOUNCE_ERR_INVALID_PARAM;
        }
        auto *m = static_cast<BounceMD *>(meta);
        const bounce_status_t st =
            m->loaded ? bounce_engine_unload_md(engine, m->md) : bounce_engine_deregister_mem(engine, m->md);
        delete m;
        return st;
    }

    bounce_engine_t *engine = nullptr;
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
        nixl_b_params_t options;
        for (size_t i = 0; i + 1 < flat.size(); i += 2) {
            options.emplace(flat[i], flat[i + 1]);
        }
        return options;
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
