# Finds zero's optional parts for its own build and creates one INTERFACE target per part:
# zero::blas, zero::openmp, zero::dnnl, zero::mpi, zero::cuda, zero::nccl, zero::uring. Each links zero::zero,
# the packages behind it, and defines ZERO_WITH_<PART>=1 so headers can tell what is available.
include_guard(GLOBAL)
include(ZeroComponents)

function(zero_find_dependencies)
  find_package(nlohmann_json 3.10 REQUIRED)
  target_link_libraries(zero INTERFACE nlohmann_json::nlohmann_json)

  set(_configured "")
  set(_targets "")
  foreach(_comp IN LISTS ZERO_KNOWN_COMPONENTS)
    string(TOUPPER "${_comp}" _COMP)
    set(_found FALSE)
    if(ZERO_WITH_${_COMP})
      zero_find_component(${_comp} _found)
    endif()
    if(_comp STREQUAL "nccl" AND NOT "cuda" IN_LIST _configured)
      set(_found FALSE)
    endif()
    add_feature_info(${_comp} _found "${ZERO_HINT_${_comp}}")
    if(NOT _found)
      if(ZERO_WITH_${_COMP})
        message(STATUS "zero: optional part '${_comp}' not found: needs ${ZERO_HINT_${_comp}}")
      endif()
      continue()
    endif()
    zero_component_link_libraries(${_comp} _libs)
    add_library(zero_${_comp} INTERFACE)
    add_library(zero::${_comp} ALIAS zero_${_comp})
    set_target_properties(zero_${_comp} PROPERTIES EXPORT_NAME ${_comp})
    target_link_libraries(zero_${_comp} INTERFACE zero ${_libs})
    target_compile_definitions(zero_${_comp} INTERFACE ZERO_WITH_${_COMP}=1)
    if(_comp STREQUAL "cuda")
      # Host/device constexpr helpers (std::bit_cast, std::min) are called from device code.
      target_compile_options(zero_${_comp} INTERFACE
        $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
    endif()
    if(_comp STREQUAL "openmp" OR _comp STREQUAL "dnnl")
      # OpenMP::OpenMP_CXX gives -fopenmp to C++ sources only; nvcc hands it to the host compiler
      # of .cu sources, whose host code (the optimizer's passes under Offload<CPU>) uses threads.
      target_compile_options(zero_${_comp} INTERFACE
        $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-fopenmp>)
    endif()
    if(_comp STREQUAL "blas")
      target_include_directories(zero_${_comp} INTERFACE
        $<BUILD_INTERFACE:${ZERO_CBLAS_INCLUDE_DIR}>)
    endif()
    list(APPEND _configured ${_comp})
    list(APPEND _targets zero_${_comp})
  endforeach()

  set(ZERO_CONFIGURED_COMPONENTS "${_configured}" PARENT_SCOPE)
  set(ZERO_COMPONENT_TARGETS "${_targets}" PARENT_SCOPE)
  message(STATUS "zero: optional parts found: ${_configured}")
endfunction()
