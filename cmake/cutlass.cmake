# CUTLASS headers: CUTLASS_DIR if given (a CUTLASS checkout), else the nvidia-cutlass wheel
# (a build requirement in pyproject.toml), located without importing it.
set(CUTLASS_DIR "$ENV{CUTLASS_DIR}" CACHE PATH "CUTLASS source tree (overrides the nvidia-cutlass wheel)")
if(CUTLASS_DIR)
  set(_cutlass_root "${CUTLASS_DIR}")
else()
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(s.submodule_search_locations[0], 'source') if s else '')"
    OUTPUT_VARIABLE _cutlass_root OUTPUT_STRIP_TRAILING_WHITESPACE)
endif()
if(NOT _cutlass_root OR NOT EXISTS "${_cutlass_root}/include/cutlass/cutlass.h")
  message(FATAL_ERROR "CUTLASS headers not found (looked in '${_cutlass_root}'). "
    "Install the nvidia-cutlass wheel (pip install nvidia-cutlass) or set CUTLASS_DIR.")
endif()
set(CUTLASS_INCLUDE_DIRS "${_cutlass_root}/include" "${_cutlass_root}/tools/util/include")
message(STATUS "moe_kernels: CUTLASS headers from ${_cutlass_root}")
