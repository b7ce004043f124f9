# Findliburing: the io_uring helper library. Sets liburing_FOUND and the imported target
# liburing::liburing. Uses pkg-config when present, plain search otherwise.
include(FindPackageHandleStandardArgs)
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(PC_LIBURING QUIET liburing)
endif()
find_path(liburing_INCLUDE_DIR liburing.h HINTS ${PC_LIBURING_INCLUDE_DIRS})
find_library(liburing_LIBRARY NAMES uring HINTS ${PC_LIBURING_LIBRARY_DIRS})
set(liburing_VERSION "${PC_LIBURING_VERSION}")
find_package_handle_standard_args(liburing REQUIRED_VARS liburing_LIBRARY liburing_INCLUDE_DIR
                                  VERSION_VAR liburing_VERSION)
if(liburing_FOUND AND NOT TARGET liburing::liburing)
  add_library(liburing::liburing UNKNOWN IMPORTED)
  set_target_properties(liburing::liburing PROPERTIES IMPORTED_LOCATION "${liburing_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${liburing_INCLUDE_DIR}")
endif()
mark_as_advanced(liburing_INCLUDE_DIR liburing_LIBRARY)
