// attncore: the layout of a params struct, exported so that its ctypes mirror is checked field by field.
//
// A params struct is the one contract between a backend's binding.py (a ctypes.Structure) and its
// kernels.  A field added, removed, reordered or retyped on one side only would shift every field
// after it: the kernel reads garbage, with no error.  So the struct is declared from one X-macro
// list of (type, name), and the same list generates the export, which therefore cannot drift from
// the struct:
//
//   #define MY_PARAMS_FIELDS(F) F(const void*, q) F(int64_t, q_stride) F(int32_t, heads) ...
//   struct MyParams { MY_PARAMS_FIELDS(AC_FIELD_DECL) };
//   AC_EXPORT_LAYOUT(my_params, MyParams, MY_PARAMS_FIELDS)      // in one .cu of the library
//
// defines, extern "C":
//   int my_params_size()                      sizeof(MyParams)
//   int my_params_offsets(int* out, int cap)  offsetof of every field in declaration order into out
//                                             (at most cap of them); returns the number of fields
//   const char* my_params_fields()            the field names, in the same order, space-separated
// binding.py compares them with `Struct.<field>.offset` and names the first field that differs.
// (Comments inside a field list must be /* */: a // comment would swallow the line continuation.)
#pragma once
#include <stddef.h>

#define AC_FIELD_DECL(type, name) type name;
#define AC_FIELD_OFFSET(type, name)                     \
  if (ac_n_ < cap) out[ac_n_] = (int)offsetof(AcS_, name); \
  ++ac_n_;
#define AC_FIELD_NAME(type, name) #name " "

#define AC_EXPORT_LAYOUT(PREFIX, STRUCT, FIELDS)                                                     \
  extern "C" __attribute__((visibility("default"))) int PREFIX##_size() { return (int)sizeof(STRUCT); } \
  extern "C" __attribute__((visibility("default"))) int PREFIX##_offsets(int* out, int cap) {         \
    using AcS_ = STRUCT;                                                                             \
    int ac_n_ = 0;                                                                                   \
    FIELDS(AC_FIELD_OFFSET)                                                                          \
    return ac_n_;                                                                                    \
  }                                                                                                  \
  extern "C" __attribute__((visibility("default"))) const char* PREFIX##_fields() { return FIELDS(AC_FIELD_NAME); }
