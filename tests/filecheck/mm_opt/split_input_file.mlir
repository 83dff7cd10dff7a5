// RUN: mm-opt %s --split-input-file | filecheck %s
// RUN: mm-opt %s --split-input-file | mm-opt --split-input-file | filecheck %s

// Each chunk is parsed on its own and the outputs are joined by the marker.
// CHECK-LABEL: func @first
// CHECK: // -----
// CHECK-LABEL: func @second
// CHECK-NOT: // -----
func.func @first() {
  return
}

// -----

func.func @second() {
  return
}
