# Included right after llama.cpp's own project() (scripts/build_llama_cpp.sh passes it as
# CMAKE_PROJECT_llama.cpp_INCLUDE). llama-cpp-python forces LLAMA_BUILD_COMMON=ON into the cache, but neither its
# bindings nor reprotune load libllama-common (plus cpp-httplib): 63 of the 140 ninja steps, about 3 of the 6 minutes
# on 2 cores. A normal variable shadows that cache entry (CMP0126, CMP0077), so common/ is never configured.
set(LLAMA_BUILD_COMMON OFF)
