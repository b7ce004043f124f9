# The kill-one-rank test (ctest -P script): 4 ranks train, rank 3 SIGKILLs itself, the three
# survivors must each report a CommError naming it within the deadline (survivor_<r>.txt); then
# 3 ranks resume from the last checkpoint and must equal the uninterrupted run.
# Open MPI aborts the whole job when a process dies unless orte_abort_on_non_zero_status is 0;
# mpiexec's own exit code then reports the dead rank, so phase 1 is judged by the files.
# Inputs: -DMPIEXEC=<mpiexec> -DFLAGS=<a|b|...> -DPROGRAM=<kill_rank_resume> -DDIR=<scratch dir>
string(REPLACE "|" ";" FLAGS "${FLAGS}")
file(REMOVE_RECURSE "${DIR}")
file(MAKE_DIRECTORY "${DIR}")

execute_process(
  COMMAND "${MPIEXEC}" -n 4 ${FLAGS} --mca orte_abort_on_non_zero_status 0 "${PROGRAM}" kill
          "${DIR}"
  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
message("phase 1 (4 ranks, rank 3 killed), mpiexec exit ${rc}:\n${out}")
foreach(r 0 1 2)
  if(NOT EXISTS "${DIR}/survivor_${r}.txt")
    message(FATAL_ERROR "survivor rank ${r} wrote no result (hung or crashed?)\n${err}")
  endif()
  file(READ "${DIR}/survivor_${r}.txt" result)
  if(NOT result MATCHES "^ok\n")
    message(FATAL_ERROR "survivor rank ${r}: ${result}")
  endif()
endforeach()
if(EXISTS "${DIR}/survivor_3.txt")
  message(FATAL_ERROR "rank 3 was meant to die but wrote a result")
endif()

execute_process(COMMAND "${MPIEXEC}" -n 3 ${FLAGS} "${PROGRAM}" resume "${DIR}"
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
message("phase 2 (3 ranks resume), exit ${rc}:\n${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "resume at 3 ranks failed:\n${err}")
endif()
