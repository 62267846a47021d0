"""C++ (CPU) and CUDA kernels for the precision engine's hot paths, and the loader that builds
them with ninja. The kernels arrive with the kernels issue; until then the engine uses torch ops."""
