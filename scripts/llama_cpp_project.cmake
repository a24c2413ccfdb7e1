# Included right after llama.cpp's own project() (scripts/build_llama_cpp.sh passes it as
# CMAKE_PROJECT_llama.cpp_INCLUDE): one build tree serves both the wheel and the two tools 'make gguf' runs.
#
# 1. The wheel's configure: llama-cpp-python forces LLAMA_BUILD_COMMON=ON into the cache, but neither its bindings
#    nor reprotune load libllama-common (plus cpp-httplib): 63 of the 140 ninja steps. A normal variable shadows that
#    cache entry (CMP0126, CMP0077), so common/ is never configured and the wheel's target compiles none of it.
# 2. The tools' configure (REPROTUNE_LLAMA_TOOLS=ON, LLAMA_BUILD_TOOLS=ON: the same tree, after the wheel is built):
#    common/ and tools/ join; scripts/build_llama_cpp.sh builds only llama-imatrix and llama-quantize, linked against
#    the libllama and libggml already compiled for the wheel (no second compile of them). Their run path becomes
#    $ORIGIN: the script copies each tool and the libraries it loads into one folder.
if(NOT REPROTUNE_LLAMA_TOOLS)
    set(LLAMA_BUILD_COMMON OFF)
else()
    function(reprotune_tools_run_path)
        foreach(target llama-common llama-quantize-impl llama-quantize llama-imatrix)
            set_target_properties(${target} PROPERTIES BUILD_WITH_INSTALL_RPATH TRUE INSTALL_RPATH "$ORIGIN")
        endforeach()
    endfunction()
    cmake_language(DEFER CALL reprotune_tools_run_path)
endif()
