// nixl-bounce's own declarations of the subset of the NIXL 1.5 C++ plugin ABI
// that the BOUNCE shim uses.
//
// Written for this project from the public interface description of NIXL
// (classes nixlBackendEngine, nixlBackendInitParams, nixlDescList<T>,
// nixlBasicDesc / nixlBlobDesc / nixlMetaDesc, nixlBackendMD, nixlBackendReqH,
// nixlBackendPlugin). Only what crosses the boundary is declared, but every
// class that NIXL reads or writes inside our objects is declared with exactly
// the data members, in order, and exactly the virtual methods, in order, of
// NIXL 1.5: NIXL's own inline code (compiled into libnixl.so) reads fields of
// our engine object at fixed offsets, and calls our overrides through vtable
// slots.
//
// Nothing here may call a non-inline NIXL function: the plugin links against no
// NIXL library, so every method defined here is inline and self-contained.
// The layout is pinned by static_asserts at the end of this file and checked
// against a live NIXL by tests/abi.rs.
#pragma once

#include <cstddef>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// ---- nixl_types.h subset ---------------------------------------------------

enum nixl_mem_t { DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG };

enum nixl_xfer_op_t { NIXL_READ, NIXL_WRITE };

enum nixl_status_t {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12,
};

enum class nixl_thread_sync_t { NIXL_THREAD_SYNC_NONE, NIXL_THREAD_SYNC_STRICT, NIXL_THREAD_SYNC_RW };

using nixl_backend_t = std::string;
using nixl_blob_t = std::string;
using nixl_mem_list_t = std::vector<nixl_mem_t>;
using nixl_b_params_t = std::unordered_map<std::string, std::string>;
using nixl_query_resp_t = std::optional<nixl_b_params_t>;
using nixlMemViewH = void *;

// Only ever passed by pointer/reference through slots we do not override.
class nixlBackendH;
struct nixlAgentOptionalArgs;
enum class nixl_cost_t { ANALYTICAL_BACKEND = 0 };

// ---- descriptors -------------------------------------------------------------

class nixlBasicDesc {
public:
    uintptr_t addr;
    size_t len;
    uint64_t devId;
};

class nixlBlobDesc : public nixlBasicDesc {
public:
    nixl_blob_t metaInfo;
};

class nixlBackendMD;

class nixlMetaDesc : public nixlBasicDesc {
public:
    nixlBackendMD *metadataP;
};

struct nixlRemoteMetaDesc : public nixlMetaDesc {
    std::string remoteAgent;
};

// A descriptor list as NIXL lays it out: a vtable pointer, the memory type,
// then the vector of descriptors, with NIXL's four virtual methods in order.
// The shim reads lists that NIXL built, and builds lists of its own only to
// hand them to NIXL's UCX engine (src/plugins/ucx reads them through the
// inline accessors below, never through the vtable). The virtuals are defined
// here, inline and hidden, so that a list built here has a vtable of ours
// and the plugin needs no NIXL symbol.
template <class T> class nixlDescList {
protected:
    nixl_mem_t type;
    std::vector<T> descs;

public:
    explicit nixlDescList(nixl_mem_t mem_type) : type(mem_type) {}
    nixlDescList(const nixlDescList &) = delete;
    nixlDescList &operator=(const nixlDescList &) = delete;
    virtual ~nixlDescList() = default;
    virtual void resize(const size_t &count) { descs.resize(count); }
    virtual void addDesc(const T &desc) { descs.push_back(desc); }
    virtual int getIndex(const nixlBasicDesc &query) const {
        for (size_t i = 0; i < descs.size(); ++i) {
            const nixlBasicDesc &d = descs[i];
            if (d.addr == query.addr && d.len == query.len && d.devId == query.devId) {
                return static_cast<int>(i);
            }
        }
        return -4; // NIXL_ERR_NOT_FOUND
    }

    nixl_mem_t getType() const { return type; }
    int descCount() const { return static_cast<int>(descs.size()); }
    bool isEmpty() const noexcept { return descs.empty(); }
    const T &operator[](size_t index) const { return descs[index]; }
    void reserve(size_t count) { descs.reserve(count); }
    template <class... Args> T &emplace(Args &&...args) { return descs.emplace_back(std::forward<Args>(args)...); }
};

using nixl_meta_dlist_t = nixlDescList<nixlMetaDesc>;
using nixl_remote_meta_dlist_t = nixlDescList<nixlRemoteMetaDesc>;
using nixl_reg_dlist_t = nixlDescList<nixlBlobDesc>;

// ---- backend_aux.h subset ----------------------------------------------------

using notif_list_t = std::vector<std::pair<std::string, std::string>>;

struct nixlBackendOptionalArgs {
    nixl_blob_t notifMsg;
    bool hasNotif = false;
    nixl_blob_t customParam;
};
using nixl_opt_b_args_t = nixlBackendOptionalArgs;

class nixlBackendInitParams {
public:
    std::string localAgent;
    nixl_backend_t type;
    nixl_b_params_t *customParams = nullptr;
    bool enableProgTh = false;
    uint64_t pthrDelay = 0; // nixlTime::us_t
    nixl_thread_sync_t syncMode;
    bool enableTelemetry_ = false;
};

class nixlBackendReqH {
public:
    nixlBackendReqH() {}
    virtual ~nixlBackendReqH() {}
};

class nixlBackendMD {
protected:
    bool isPrivateMD;

public:
    explicit nixlBackendMD(bool is_private) : isPrivateMD(is_private) {}
    virtual ~nixlBackendMD() {}
};

// ---- telemetry (only its size and destructor matter to us) ------------------

enum class nixl_telemetry_event_type_t : uint32_t { AGENT_TX_BYTES = 0 };

struct nixlTelemetryEvent {
    nixl_telemetry_event_type_t eventType_;
    uint64_t value_;
};

// ---- backend_engine.h ----------------------------------------------------------
// Data members and virtual methods in NIXL's order. The bodies of the
// non-pure virtuals are NIXL's documented defaults ("not supported").

class nixlBackendEngine {
private:
    nixl_backend_t backendType;
    nixl_b_params_t customParams;
    std::vector<nixlTelemetryEvent> telemetryEvents_;
    std::mutex telemetryEventsMutex_;

protected:
    bool initErr = false;
    const std::string localAgent;
    const bool enableTelemetry_;

public:
    explicit nixlBackendEngine(const nixlBackendInitParams *init_params)
        : backendType(init_params->type),
          customParams(*init_params->customParams),
          localAgent(init_params->localAgent),
          enableTelemetry_(init_params->enableTelemetry_) {}

    nixlBackendEngine(const nixlBackendEngine &) = delete;
    nixlBackendEngine &operator=(const nixlBackendEngine &) = delete;

    virtual ~nixlBackendEngine() = default;

    bool getInitErr() const noexcept { return initErr; }
    const nixl_b_params_t &getCustomParams() const noexcept { return customParams; }

    virtual bool supportsRemote() const = 0;
    virtual bool supportsLocal() const = 0;
    virtual bool supportsNotif() const = 0;
    virtual nixl_mem_list_t getSupportedMems() const = 0;

    virtual nixl_status_t
    registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) = 0;
    virtual nixl_status_t deregisterMem(nixlBackendMD *meta) = 0;

    virtual nixl_status_t connect(const std::string &remote_agent) = 0;
    virtual nixl_status_t disconnect(const std::string &remote_agent) = 0;

    virtual nixl_status_t unloadMD(nixlBackendMD *input) = 0;

    virtual nixl_status_t prepXfer(const nixl_xfer_op_t &operation,
                                   const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote,
                                   const std::string &remote_agent,
                                   nixlBackendReqH *&handle,
                                   const nixl_opt_b_args_t *opt_args = nullptr) const = 0;
    virtual nixl_status_t postXfer(const nixl_xfer_op_t &operation,
                                   const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote,
                                   const std::string &remote_agent,
                                   nixlBackendReqH *&handle,
                                   const nixl_opt_b_args_t *opt_args = nullptr) const = 0;
    virtual nixl_status_t checkXfer(nixlBackendReqH *handle) const = 0;
    virtual nixl_status_t releaseReqH(nixlBackendReqH *handle) const = 0;

    virtual nixl_status_t
    prepMemView(const nixl_remote_meta_dlist_t &, nixlMemViewH &, const nixl_opt_b_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t
    prepMemView(const nixl_meta_dlist_t &, nixlMemViewH &, const nixl_opt_b_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual void releaseMemView(nixlMemViewH) const {}

    virtual nixl_status_t getPublicData(const nixlBackendMD *, std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t getConnInfo(std::string &) const { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t loadRemoteConnInfo(const std::string &, const std::string &) {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t
    loadRemoteMD(const nixlBlobDesc &, const nixl_mem_t &, const std::string &, nixlBackendMD *&) {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t loadLocalMD(nixlBackendMD *, nixlBackendMD *&) { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t getNotifs(notif_list_t &) { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t genNotif(const std::string &, const std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t queryMem(const nixl_reg_dlist_t &, std::vector<nixl_query_resp_t> &) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t estimateXferCost(const nixl_xfer_op_t &,
                                           const nixl_meta_dlist_t &,
                                           const nixl_meta_dlist_t &,
                                           const std::string &,
                                           nixlBackendReqH *const &,
                                           std::chrono::microseconds &,
                                           std::chrono::microseconds &,
                                           nixl_cost_t &,
                                           const nixlAgentOptionalArgs * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
};

// ---- backend_plugin.h ----------------------------------------------------------

#define NIXL_PLUGIN_API_VERSION 1

class nixlBackendPlugin {
public:
    int api_version;
    nixlBackendEngine *(*create_engine)(const nixlBackendInitParams *init_params);
    void (*destroy_engine)(nixlBackendEngine *engine);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    nixl_b_params_t (*get_backend_options)();
    nixl_mem_list_t (*get_backend_mems)();
};

// ---- layout pins (x86-64 / aarch64 Linux, libstdc++ with the C++11 ABI) -----
// Sizes follow from NIXL 1.5.1's declarations; a failure here means the
// declarations above no longer describe the installed NIXL.
static_assert(sizeof(nixlBasicDesc) == 24, "nixlBasicDesc layout");
static_assert(sizeof(nixlBlobDesc) == 56, "nixlBlobDesc layout");
static_assert(sizeof(nixlMetaDesc) == 32, "nixlMetaDesc layout");
static_assert(sizeof(nixlDescList<nixlMetaDesc>) == 40, "nixlDescList layout");
static_assert(sizeof(nixlBackendOptionalArgs) == 72, "nixlBackendOptionalArgs layout");
static_assert(sizeof(nixlTelemetryEvent) == 16, "nixlTelemetryEvent layout");
// The shim builds these for NIXL's UCX engine (plugin/bounce_plugin.cpp), so
// their layout is NIXL's as well.
static_assert(sizeof(nixlBackendInitParams) == 96, "nixlBackendInitParams layout");
static_assert(sizeof(nixlBackendMD) == 16, "nixlBackendMD layout");
