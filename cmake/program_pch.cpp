// The owner of the programs' precompiled <torch/torch.h> (cmake/TandemPrograms.cmake): every
// program reuses the header this target compiles. Not installed, not run.
int main() { return 0; }
