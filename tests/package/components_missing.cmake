# cmake -P script: a consumer that asks for an unknown component, or for one that the install
# was configured without, must fail to configure with a message saying what to install.
file(REMOVE_RECURSE "${WORK_DIR}")

# 1. An install of zero configured without liburing.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${ZERO_SOURCE_DIR} -B ${WORK_DIR}/zero-build
                  -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX} -DZERO_WITH_URING=OFF
                  -DZERO_WITH_CUDA=OFF -DZERO_WITH_NCCL=OFF -DZERO_BUILD_TESTS=OFF
                  -DZERO_BUILD_EXAMPLES=OFF -DZERO_BUILD_BENCHMARKS=OFF -DZERO_INSTALL=ON
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring zero without liburing failed:\n${out}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --install ${WORK_DIR}/zero-build
                  --prefix ${WORK_DIR}/prefix RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "installing zero failed")
endif()

# consumer_must_fail(<components> <regex>): configure the consumer and expect failure + regex.
function(consumer_must_fail components regex)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/consumer-${components}
                    -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
                    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCONSUMER_MODE=find_package
                    -DCONSUMER_COMPONENTS=${components}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc EQUAL 0)
    message(FATAL_ERROR "asking for '${components}' should fail to configure, but it passed")
  endif()
  if(NOT out MATCHES "${regex}")
    message(FATAL_ERROR "asking for '${components}' failed without the expected message "
                        "'${regex}':\n${out}")
  endif()
endfunction()

consumer_must_fail(uring "liburing-dev")
consumer_must_fail(warp_drive "has no component 'warp_drive'")
message("components_missing ok")
