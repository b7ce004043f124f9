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
