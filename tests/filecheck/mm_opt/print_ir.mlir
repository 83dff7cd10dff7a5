// RUN: %{mm-opt} %s -p 'builtin.module(mm-verify,canonicalize)' --mlir-print-ir-before-all --mlir-print-ir-after-all 2>&1 >/dev/null | filecheck %s
// RUN: %{mm-opt} %s -p 'builtin.module(mm-verify)' --mlir-timing 2>&1 >/dev/null | filecheck %s --check-prefix=TIMING
// RUN: %{mm-opt} %s --mlir-print-debuginfo | filecheck %s --check-prefix=LOC

// IR dumps go to stderr, one per pipeline step, with MLIR's header.
// CHECK: // -----// IR Dump Before mm-verify //----- //
// CHECK: // -----// IR Dump After mm-verify //----- //
// CHECK: // -----// IR Dump Before canonicalize //----- //
// CHECK: // -----// IR Dump After canonicalize //----- //
// CHECK-NOT: stablehlo.add

// TIMING: Execution time report
// TIMING: Wall Time
// TIMING: mm-verify
// TIMING: Total

// Locations point into this file, at the op's line and column.
// LOC: loc("{{.*}}print_ir.mlir":20:8)
func.func @fold(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.add %arg0, %arg0 : tensor<4xf32>
  %1 = stablehlo.constant dense<0.0> : tensor<4xf32>
  return %arg0 : tensor<4xf32>
}
