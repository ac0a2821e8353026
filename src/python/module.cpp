// The pybind11 extension `moe_kernels._C`. It holds no kernels: on first use it finds the
// per-arch library (libmoe_kernels_<arch>.so, next to this module) whose arch matches the
// GPU, dlopens it, checks its ABI version and forwards calls through the C ABI. Importing
// it needs no GPU, and it never links libtorch: tensors arrive as raw pointers.
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "moe_kernels/c_api.h"

namespace py = pybind11;

namespace {

struct ArchLibrary {
  std::string path;
  int (*abi_version)();
  const char* (*arch)();
  int (*supports_cc)(int, int);
  int (*cuda_version)();
  int (*num_kernels)();
  const moek_kernel_info* (*kernel)(int);
  int (*check_kernel)(const char*, const moek_shape*, int32_t, char*, size_t);
  int (*workspace_size)(const moek_shape*, int32_t, size_t*, char*, size_t);
  int (*run)(const moek_args*, char*, size_t);
  int (*read_probe)(const void*, size_t, int32_t, unsigned long long*, int32_t, void*, char*, size_t);
};

std::string module_dir() {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(&module_dir), &info) || !info.dli_fname) return ".";
  std::string p(info.dli_fname);
  auto slash = p.rfind('/');
  return slash == std::string::npos ? "." : p.substr(0, slash);
}

template <typename F>
void bind(void* handle, const std::string& path, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(handle, name));
  if (!*fn) throw std::runtime_error(path + " does not export " + name);
}

ArchLibrary open_library(const std::string& path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) throw std::runtime_error("cannot load " + path + ": " + dlerror());
  ArchLibrary lib;
  lib.path = path;
  bind(h, path, "moek_abi_version", &lib.abi_version);
  int abi = lib.abi_version();
  if (abi != MOEK_ABI_VERSION)
    throw std::runtime_error(path + " has ABI version " + std::to_string(abi) +
                             ", this module expects " + std::to_string(MOEK_ABI_VERSION) +
                             ": the package is a mix of two builds; reinstall it");
  bind(h, path, "moek_arch", &lib.arch);
  bind(h, path, "moek_supports_cc", &lib.supports_cc);
  bind(h, path, "moek_cuda_version", &lib.cuda_version);
  bind(h, path, "moek_num_kernels", &lib.num_kernels);
  bind(h, path, "moek_kernel", &lib.kernel);
  bind(h, path, "moek_check_kernel", &lib.check_kernel);
  bind(h, path, "moek_workspace_size", &lib.workspace_size);
  bind(h, path, "moek_run", &lib.run);
  bind(h, path, "moek_read_probe", &lib.read_probe);
  return lib;  // the handle stays open for the life of the process
}

// All per-arch libraries shipped next to this module, loaded once, keyed by arch name.
std::map<std::string, ArchLibrary>& libraries() {
  static std::map<std::string, ArchLibrary> libs;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string dir = module_dir();
    if (DIR* d = opendir(dir.c_str())) {
      while (dirent* ent = readdir(d)) {
        std::string f = ent->d_name;
        const std::string pre = "libmoe_kernels_", post = ".so";
        if (f.size() > pre.size() + post.size() && f.compare(0, pre.size(), pre) == 0 &&
            f.compare(f.size() - post.size(), post.size(), post) == 0) {
          ArchLibrary lib = open_library(dir + "/" + f);
          libs.emplace(lib.arch(), lib);
        }
      }
      closedir(d);
    }
  });
  return libs;
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

py::dict device_info(int device) {
  int count = 0;
  check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (device < 0 || device >= count)
    throw std::invalid_argument("device " + std::to_string(device) + " out of range: " +
                                std::to_string(count) + " CUDA devices");
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  py::dict d;
  d["name"] = std::string(prop.name);
  d["major"] = prop.major;
  d["minor"] = prop.minor;
  d["sm_count"] = prop.multiProcessorCount;
  d["smem_per_block_optin"] = static_cast<int64_t>(prop.sharedMemPerBlockOptin);
  d["l2_bytes"] = prop.l2CacheSize;
  return d;
}

// The library for `device`, or an error naming the GPU and what this build holds.
const ArchLibrary& library_for(int device) {
  static std::map<int, const ArchLibrary*> by_device;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto it = by_device.find(device);
  if (it != by_device.end()) return *it->second;
  int major = 0, minor = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
             "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
             "cudaDeviceGetAttribute");
  std::string built;
  for (auto& [arch, lib] : libraries()) {
    if (lib.supports_cc(major, minor)) return *(by_device[device] = &lib);
    built += (built.empty() ? "" : ", ") + arch;
  }
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  throw std::runtime_error(std::string("moe_kernels has no kernels for ") + prop.name +
                           " (compute capability " + std::to_string(major) + "." +
                           std::to_string(minor) + "); this build holds: " +
                           (built.empty() ? "nothing" : built));
}

void raise_status(int status, const char* err) {
  if (status == MOEK_OK) return;
  if (status == MOEK_INVALID_ARGUMENT) throw std::invalid_argument(err);
  throw std::runtime_error(err);
}

// The shape dict is built in one place, moe_kernels.problem.c_shape.
moek_shape make_shape(py::dict s) {
  moek_shape r{};
  r.num_tokens = s["num_tokens"].cast<int64_t>();
  r.hidden_size = s["hidden_size"].cast<int64_t>();
  r.inter_size = s["inter_size"].cast<int64_t>();
  r.num_experts = s["num_experts"].cast<int64_t>();
  r.top_k = s["top_k"].cast<int64_t>();
  r.expert_offset = s["expert_offset"].cast<int64_t>();
  r.dtype = s["dtype"].cast<int32_t>();
  r.act_format = s["act_format"].cast<int32_t>();
  r.weight_format = s["weight_format"].cast<int32_t>();
  r.activation = s["activation"].cast<int32_t>();
  r.index_dtype = s["index_dtype"].cast<int32_t>();
  r.act_alpha = s["act_alpha"].cast<float>();
  r.act_limit = s["act_limit"].cast<float>();
  r.w13_scale_per_channel = s["w13_scale_per_channel"].cast<int32_t>();
  r.w2_scale_per_channel = s["w2_scale_per_channel"].cast<int32_t>();
  r.weight_group = s["weight_group"].cast<int32_t>();
  r.weight_zero = s["weight_zero"].cast<int32_t>();
  r.router_weight_on_input = s["router_weight_on_input"].cast<int32_t>();
  r.routed_scaling_factor = s["routed_scaling_factor"].cast<float>();
  r.expert_map_size = s["expert_map_size"].cast<int64_t>();
  return r;
}

py::dict library_info(const ArchLibrary& lib) {
  py::dict d;
  d["arch"] = std::string(lib.arch());
  d["path"] = lib.path;
  d["cuda_version"] = lib.cuda_version();
  py::list kernels;
  for (int i = 0; i < lib.num_kernels(); ++i) {
    const moek_kernel_info* k = lib.kernel(i);
    py::dict kd;
    kd["name"] = std::string(k->name);
    kd["mode"] = std::string(k->mode);
    kd["act_format"] = k->act_format;
    kd["weight_format"] = k->weight_format;
    kd["out_dtype"] = k->out_dtype;
    kd["kind"] = k->kind;
    kd["schedule"] = std::string(k->schedule);
    kd["mainloop"] = std::string(k->mainloop);
    kd["swap_ab"] = k->swap_ab != 0;
    kd["tile"] = py::make_tuple(k->tile_m, k->tile_n, k->tile_k);
    kd["cluster"] = py::make_tuple(k->cluster_m, k->cluster_n);
    kd["smem_bytes"] = k->smem_bytes;
    kernels.append(kd);
  }
  d["kernels"] = kernels;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "moe_kernels native bridge: loads the per-arch kernel library for the GPU";
  m.attr("ABI_VERSION") = MOEK_ABI_VERSION;
  py::list kinds;  // moek_kernel_kind names, by code
  for (const char* kind : moe_kernels::kKernelKinds) kinds.append(kind);
  m.attr("KERNEL_KINDS") = py::tuple(kinds);

  m.def("driver_version", [] {
    int v = 0;
    return cudaDriverGetVersion(&v) == cudaSuccess ? v : 0;
  }, "The CUDA version the installed driver supports (e.g. 13000), 0 when there is no driver");
  m.def("device_count", [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  }, "CUDA devices visible to this process (0 when there is no driver or GPU)");
  m.def("device_info", &device_info, py::arg("device"));
  m.def("libraries", [] {
    py::list out;
    for (auto& [arch, lib] : libraries()) out.append(library_info(lib));
    return out;
  }, "Every per-arch library in this build, with its kernels; needs no GPU");
  m.def("library_for", [](int device) { return library_info(library_for(device)); },
        py::arg("device"));
  m.def("check_kernel", [](int device, const std::string& name, py::object shape) {
    char err[512] = {0};
    moek_shape s{};
    if (!shape.is_none()) s = make_shape(shape.cast<py::dict>());
    int st = library_for(device).check_kernel(name.c_str(), shape.is_none() ? nullptr : &s, device,
                                              err, sizeof(err));
    return st == MOEK_OK ? std::string() : std::string(err);
  }, py::arg("device"), py::arg("name"), py::arg("shape") = py::none(),
     "Empty string if kernel `name` can run on `device` (and serve a forward of `shape`, when "
     "given), else why not");
  m.def("workspace_size", [](int device, py::dict shape) {
    moek_shape s = make_shape(shape);
    size_t bytes = 0;
    char err[512] = {0};
    raise_status(library_for(device).workspace_size(&s, device, &bytes, err, sizeof(err)), err);
    return bytes;
  }, py::arg("device"), py::arg("shape"));
  // The forward path converts a problem's shape once (ops.Plan) and passes this object on
  // every call, instead of a dict read key by key.
  py::class_<moek_shape>(m, "Shape", "A forward's moek_shape, from moe_kernels.problem.c_shape's dict")
      .def(py::init(&make_shape), py::arg("shape"));
  m.def("run", [](int device, const moek_shape& shape, uintptr_t hidden, uintptr_t topk_ids,
                  uintptr_t topk_weights, uintptr_t w13, uintptr_t w2, uintptr_t w13_bias,
                  uintptr_t w2_bias, uintptr_t w13_scale, uintptr_t w2_scale,
                  uintptr_t a13_scale, uintptr_t a2_scale, uintptr_t w13_zero, uintptr_t w2_zero,
                  uintptr_t expert_map, uintptr_t out, uintptr_t workspace,
                  size_t workspace_bytes, const std::string& forward,
                  const std::string& gemm1, const std::string& gemm2, uintptr_t stream,
                  int last_step) {
    moek_args a{};
    a.shape = shape;
    a.hidden = reinterpret_cast<const void*>(hidden);
    a.topk_ids = reinterpret_cast<const void*>(topk_ids);
    a.topk_weights = reinterpret_cast<const float*>(topk_weights);
    a.w13 = reinterpret_cast<const void*>(w13);
    a.w2 = reinterpret_cast<const void*>(w2);
    a.w13_bias = reinterpret_cast<const void*>(w13_bias);
    a.w2_bias = reinterpret_cast<const void*>(w2_bias);
    a.w13_scale = reinterpret_cast<const void*>(w13_scale);
    a.w2_scale = reinterpret_cast<const void*>(w2_scale);
    a.a13_scale = reinterpret_cast<const float*>(a13_scale);
    a.a2_scale = reinterpret_cast<const float*>(a2_scale);
    a.w13_zero = reinterpret_cast<const void*>(w13_zero);
    a.w2_zero = reinterpret_cast<const void*>(w2_zero);
    a.expert_map = reinterpret_cast<const int32_t*>(expert_map);
    a.out = reinterpret_cast<void*>(out);
    a.workspace = reinterpret_cast<void*>(workspace);
    a.workspace_bytes = workspace_bytes;
    // Empty names are absent: a forward kernel, or the two GEMM kernels.
    a.forward = forward.empty() ? nullptr : forward.c_str();
    a.gemm1 = gemm1.empty() ? nullptr : gemm1.c_str();
    a.gemm2 = gemm2.empty() ? nullptr : gemm2.c_str();
    a.device = device;
    a.stream = reinterpret_cast<void*>(stream);
    a.last_step = last_step;
    char err[512] = {0};
    const ArchLibrary& lib = library_for(device);
    int st;
    {
      py::gil_scoped_release release;
      st = lib.run(&a, err, sizeof(err));
    }
    raise_status(st, err);
  }, py::arg("device"), py::arg("shape"), py::arg("hidden"), py::arg("topk_ids"),
     py::arg("topk_weights"), py::arg("w13"), py::arg("w2"), py::arg("w13_bias"),
     py::arg("w2_bias"), py::arg("w13_scale"), py::arg("w2_scale"), py::arg("a13_scale"),
     py::arg("a2_scale"), py::arg("w13_zero"), py::arg("w2_zero"), py::arg("expert_map"), py::arg("out"), py::arg("workspace"), py::arg("workspace_bytes"),
     py::arg("forward"), py::arg("gemm1"), py::arg("gemm2"), py::arg("stream"),
     py::arg("last_step") = 0);
  m.def("read_probe", [](int device, uintptr_t data, size_t bytes, int method, uintptr_t checksum,
                         uintptr_t stream) {
    char err[512] = {0};
    raise_status(library_for(device).read_probe(reinterpret_cast<const void*>(data), bytes, method,
                                                reinterpret_cast<unsigned long long*>(checksum), device,
                                                reinterpret_cast<void*>(stream), err, sizeof(err)),
                 err);
  }, py::arg("device"), py::arg("data"), py::arg("bytes"), py::arg("method"), py::arg("checksum"),
     py::arg("stream"),
     "Read `bytes` at `data` on `stream`, XOR-reducing its 16-byte words into the two uint64 at "
     "`checksum`: the benchmark's read-only streaming probe (method 0: vector loads)");
}
