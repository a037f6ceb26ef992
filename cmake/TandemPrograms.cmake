# What every program of the tree shares (the CLI, the examples, the benchmarks, the tests and their
# workers): warnings, an optimization level of their own, and one precompiled <torch/torch.h>.
#
# Where a build's time goes (scripts/test.sh prints it): parsing LibTorch's headers is 20-25 s of
# every file that includes them on this 2-core machine, and generating code for the templates they
# instantiate under the sanitizers is most of the rest. So:
#  - TANDEM_PRECOMPILED_HEADERS: <torch/torch.h> is compiled once for the library and once for all
#    programs (REUSE_FROM one owner target), not parsed again in every file. Files that include no
#    LibTorch API header skip it (loading the precompiled header costs more than their own parse).
#  - TANDEM_PROGRAM_OPTIMIZATION: an optimization flag for the programs only (scripts/test.sh
#    passes -O0): their own code is a thin loop around the library and LibTorch, whose kernels and
#    tandem's own code keep the build type's level. Empty: the build type's flags.

option(TANDEM_PRECOMPILED_HEADERS "Precompile <torch/torch.h> once for the library and once for the programs" ON)
set(TANDEM_PROGRAM_OPTIMIZATION "" CACHE STRING
    "Optimization flag of the programs (CLI, examples, benchmarks, tests), e.g. -O0; empty: the build type's")
if(TANDEM_PROGRAM_OPTIMIZATION AND NOT TANDEM_PROGRAM_OPTIMIZATION MATCHES "^-O[0-3sgz]?$")
  message(FATAL_ERROR "TANDEM_PROGRAM_OPTIMIZATION is '${TANDEM_PROGRAM_OPTIMIZATION}'; expected an "
                      "optimization flag such as -O0, -O1, -O2 or -Og, or empty for the build type's")
endif()

# The owner of the programs' precompiled header: a program with the flags every program has.
function(tandem_program_pch_owner)
  if(NOT TANDEM_PRECOMPILED_HEADERS OR TARGET tandem_program_pch)
    return()
  endif()
  add_executable(tandem_program_pch EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/cmake/program_pch.cpp)
  target_link_libraries(tandem_program_pch PRIVATE tandem)
  target_compile_options(tandem_program_pch PRIVATE ${TANDEM_WARNINGS} ${TANDEM_PROGRAM_OPTIMIZATION})
  target_precompile_headers(tandem_program_pch PRIVATE <torch/torch.h>)
endfunction()

# tandem_program(<target> [PCH [EXCEPT <sources>...]])
# Warnings and the programs' optimization level for <target>; PCH: its files start from the shared
# precompiled <torch/torch.h> (the target links tandem), but for the EXCEPT ones, which include no
# LibTorch API header. Call it in the directory that lists the sources.
function(tandem_program target)
  cmake_parse_arguments(P "PCH" "" "EXCEPT" ${ARGN})
  target_compile_options(${target} PRIVATE ${TANDEM_WARNINGS} ${TANDEM_PROGRAM_OPTIMIZATION})
  if(P_PCH AND TANDEM_PRECOMPILED_HEADERS)
    tandem_program_pch_owner()
    target_precompile_headers(${target} REUSE_FROM tandem_program_pch)
    if(P_EXCEPT)
      set_source_files_properties(${P_EXCEPT} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
    endif()
  endif()
endfunction()
