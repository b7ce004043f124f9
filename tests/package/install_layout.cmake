# cmake -P script: installs zero into a fresh PREFIX and checks the header layout: everything
# under <includedir>/zero-X.Y/ (INCLUDE_SUBDIR), nothing else at the top of <includedir>, and
# the exported zero::zero pointing at that folder.
file(REMOVE_RECURSE "${PREFIX}")  # a stale install of another layout would hide a regression
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX}
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "installing zero into ${PREFIX} failed")
endif()

foreach(_header zero/zero.hpp optim/adamw.hpp parallel/topology.hpp)
  if(NOT EXISTS "${PREFIX}/${INCLUDE_SUBDIR}/${_header}")
    message(FATAL_ERROR "${_header} is not installed under ${PREFIX}/${INCLUDE_SUBDIR}")
  endif()
endforeach()
file(GLOB _top RELATIVE "${PREFIX}/${INCLUDEDIR}" "${PREFIX}/${INCLUDEDIR}/*")
get_filename_component(_folder "${INCLUDE_SUBDIR}" NAME)
if(NOT _top STREQUAL _folder)
  message(FATAL_ERROR "${PREFIX}/${INCLUDEDIR} should hold only ${_folder}/, it holds: ${_top}")
endif()
file(READ "${PREFIX}/${CMAKE_DIR}/zeroTargets.cmake" _targets)
if(NOT _targets MATCHES "INTERFACE_INCLUDE_DIRECTORIES \"\\\${_IMPORT_PREFIX}/${INCLUDE_SUBDIR}\"")
  message(FATAL_ERROR "zero::zero's include directory is not ${INCLUDE_SUBDIR}:\n${_targets}")
endif()
foreach(_program zero-launch zero-plot-metrics)
  if(NOT EXISTS "${PREFIX}/bin/${_program}")
    message(FATAL_ERROR "${_program} is not installed under ${PREFIX}/bin")
  endif()
endforeach()
message("install layout ok: ${INCLUDE_SUBDIR}")
