# Helpers for zero's own tests, examples and benchmarks (not installed).
include_guard(GLOBAL)

# zero_target_warnings(<target>): zero's warning set; -Werror when ZERO_WERROR is on.
function(zero_target_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${ZERO_WERROR}>>:-Werror>)
endfunction()

# zero_available_parts(<out-var>): the zero::<part> targets this build found.
function(zero_available_parts out)
  set(_parts "")
  foreach(_comp IN LISTS ZERO_KNOWN_COMPONENTS)
    if(TARGET zero::${_comp})
      list(APPEND _parts zero::${_comp})
    endif()
  endforeach()
  set(${out} ${_parts} PARENT_SCOPE)
endfunction()

# zero_header_requirements(<header> <out-var>): the parts a header declares it needs in a line
# "// zero-requires: mpi cuda" among its first lines; headers without one need only zero::zero.
function(zero_header_requirements header out)
  file(STRINGS "${header}" _lines LIMIT_COUNT 8 REGEX "^// zero-requires:")
  set(_req "")
  foreach(_l IN LISTS _lines)
    string(REGEX REPLACE "^// zero-requires:[ ]*" "" _l "${_l}")
    string(REPLACE " " ";" _l "${_l}")
    list(APPEND _req ${_l})
  endforeach()
  set(${out} ${_req} PARENT_SCOPE)
endfunction()

# zero_mpiexec_flags(<out-var>): mpiexec's switches for tests: --oversubscribe, plus
# --allow-run-as-root when running as root.
function(zero_mpiexec_flags out)
  set(_flags --oversubscribe)
  execute_process(COMMAND id -u OUTPUT_VARIABLE _uid OUTPUT_STRIP_TRAILING_WHITESPACE
                  ERROR_QUIET)
  if(_uid STREQUAL "0")
    list(APPEND _flags --allow-run-as-root)
  endif()
  set(${out} ${_flags} PARENT_SCOPE)
endfunction()

# zero_add_mpi_test(NAME <name> TARGET <exe> RANKS <k> [PROGRAM] [ARGS ...]): runs <exe> "[mpi]"
# [ARGS] (PROGRAM: without the "[mpi]" test filter, for examples)
# under `mpiexec -n <k> --oversubscribe` (plus --allow-run-as-root when running as root), with
# label mpi. Open MPI's root and oversubscription switches are also set in the environment,
# so the test runs the same in containers and on small CI machines.
function(zero_add_mpi_test)
  cmake_parse_arguments(ARG "PROGRAM" "NAME;TARGET;RANKS" "ARGS" ${ARGN})
  if(NOT ARG_NAME OR NOT ARG_TARGET OR NOT ARG_RANKS)
    message(FATAL_ERROR "zero_add_mpi_test: NAME, TARGET and RANKS are required")
  endif()
  # Catch2 test executables run their [mpi] cases (-w NoTests: a spec that matches nothing
  # fails instead of passing); PROGRAM: a plain program, or a Catch2 one given its own ARGS.
  set(_tag "[mpi]" -w NoTests)
  if(ARG_PROGRAM)
    set(_tag "")
  endif()
  zero_mpiexec_flags(_flags)
  add_test(NAME ${ARG_NAME}
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ARG_RANKS} ${_flags}
                   ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${ARG_TARGET}> ${MPIEXEC_POSTFLAGS}
                   ${_tag} ${ARG_ARGS})
  set_tests_properties(${ARG_NAME} PROPERTIES
    LABELS mpi
    PROCESSORS ${ARG_RANKS}
    TIMEOUT 300
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;OMP_NUM_THREADS=1")
endfunction()

# zero_link_parts(<target> <part>...): links zero::<part> for each listed part this build found.
function(zero_link_parts target)
  foreach(_part IN LISTS ARGN)
    if(TARGET zero::${_part})
      target_link_libraries(${target} PRIVATE zero::${_part})
    endif()
  endforeach()
endfunction()
