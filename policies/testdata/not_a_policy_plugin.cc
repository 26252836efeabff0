// A shared library that is not a policy plugin: no entry point.
extern "C" int fsdp_some_other_symbol() { return 42; }
