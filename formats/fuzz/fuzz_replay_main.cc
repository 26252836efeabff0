// Replays libFuzzer inputs without libFuzzer: every file of the corpus
// directories named on the command line goes through the target's
// LLVMFuzzerTestOneInput once. With the corpora and the crashes the
// fuzzers found committed, each fuzz target is a regression test.
#include <dirent.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  int inputs = 0;
  for (int a = 1; a < argc; ++a) {
    DIR* dir = opendir(argv[a]);
    if (dir == nullptr) {
      std::fprintf(stderr, "fuzz_replay: cannot open corpus directory %s\n", argv[a]);
      return 1;
    }
    std::vector<std::string> files;
    while (dirent* entry = readdir(dir)) {
      if (entry->d_name[0] != '.') files.push_back(std::string(argv[a]) + "/" + entry->d_name);
    }
    closedir(dir);
    for (const std::string& file : files) {
      std::ifstream in(file, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++inputs;
    }
  }
  std::printf("fuzz_replay: %d inputs replayed without a crash\n", inputs);
  return inputs > 0 ? 0 : 1;
}
