# Use the CUDA toolkit that NVIDIA's PyPI wheels (cuda-toolkit[nvcc,...], nvidia-cuda-*) install
# under site-packages/nvidia/cu<major>/ when no compiler was chosen: a build from a clean clone
# in a fresh virtual environment then needs no system CUDA. Included before project().
if(DEFINED CMAKE_CUDA_COMPILER OR DEFINED ENV{CUDACXX})
  return()
endif()
set(_major "$ENV{MOE_KERNELS_CUDA}")
if(DEFINED MOE_KERNELS_CUDA)
  set(_major "${MOE_KERNELS_CUDA}")
endif()
if(NOT _major)
  set(_major 13)
endif()
if(NOT Python_EXECUTABLE)  # set by scikit-build-core; a plain CMake run uses CMake's search
  return()
endif()
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import importlib.util, os, sys
spec = importlib.util.find_spec('nvidia')
for d in (spec.submodule_search_locations if spec else []):
    root = os.path.join(d, 'cu${_major}')
    need = ('bin/nvcc', 'nvvm/bin/cicc', 'lib/libcudart_static.a', 'include/cuda_runtime.h')
    if all(os.path.isfile(os.path.join(root, f)) for f in need):  # a whole toolkit, not one part
        print(root, end='')
        break"
  OUTPUT_VARIABLE _root RESULT_VARIABLE _rc ERROR_QUIET)
if(_rc EQUAL 0 AND _root)
  message(STATUS "CUDA ${_major} toolkit from PyPI wheels: ${_root}")
  set(CMAKE_CUDA_COMPILER "${_root}/bin/nvcc" CACHE FILEPATH "CUDA compiler (PyPI toolkit)")
  set(CUDAToolkit_ROOT "${_root}" CACHE PATH "CUDA toolkit (PyPI wheels)")
  # The wheels keep libraries in lib/, where nvcc's own link line (lib64/) does not look.
  set(CMAKE_CUDA_FLAGS_INIT "-L${_root}/lib")
  # FindCUDAToolkit requires the shared runtime, which the wheel ships as libcudart.so.<major>
  # only (no unversioned link); the libraries link the static one.
  file(GLOB _cudart "${_root}/lib/libcudart.so.*")
  if(_cudart)
    list(GET _cudart 0 _cudart)
    set(CUDA_CUDART "${_cudart}" CACHE FILEPATH "CUDA runtime (PyPI toolkit)")
  endif()
endif()
