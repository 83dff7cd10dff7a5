// RUN: mm-opt %s -p 'builtin.module(mm-recompute-transfers)' --split-input-file --verify-diagnostics | filecheck %s
// RUN: mm-opt %s -p 'builtin.module(mm-recompute-transfers{max-cost=4})' --split-input-file --verify-diagnostics | filecheck %s --check-prefix=TIGHT

// `m = tanh(x) * 2` is cheap (the dot producing result #0 is not) and rooted at a program input, so @b_fwd recomputes
// it from %arg0 instead of receiving it from @a_fwd on other devices; @a_fwd no
// longer returns it. With max-cost=4 (32 elements > 4) nothing changes.
// CHECK-LABEL: func.func @main
// CHECK: %[[Y:.*]] = call @a_fwd(%arg0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
// CHECK: call @b_fwd(%[[Y]], %arg0) {mm.fragment}
// CHECK-LABEL: func.func private @b_fwd
// CHECK-SAME: (%arg0: tensor<8x4xf32>, %arg1: tensor<8x4xf32>)
// CHECK: stablehlo.tanh %arg1
// CHECK: stablehlo.multiply
// TIGHT-LABEL: func.func @main
// TIGHT: %[[R:.*]]:2 = call @a_fwd(%arg0)
// TIGHT: call @b_fwd(%[[R]]#0, %[[R]]#1)
module {
  func.func @main(%arg0: tensor<8x4xf32>) -> tensor<8x4xf32> {
    %0:2 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8x4xf32>) -> (tensor<8x4xf32>, tensor<8x4xf32>)
    %1 = call @b_fwd(%0#0, %0#1) {mm.fragment} : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
    return %1 : tensor<8x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8x4xf32>) -> (tensor<8x4xf32>, tensor<8x4xf32>) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = stablehlo.tanh %arg0 : tensor<8x4xf32>
    %cst = stablehlo.constant dense<2.000000e+00> : tensor<8x4xf32>
    %1 = stablehlo.multiply %0, %cst : tensor<8x4xf32>
    %2 = stablehlo.dot_general %1, %1, contracting_dims = [1] x [1] : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<8x8xf32>
    %3 = stablehlo.slice %2 [0:8, 0:4] : (tensor<8x8xf32>) -> tensor<8x4xf32>
    return %3, %1 : tensor<8x4xf32>, tensor<8x4xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8x4xf32>, %arg1: tensor<8x4xf32>) -> tensor<8x4xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8x4xf32>
    return %0 : tensor<8x4xf32>
  }
}

// -----

// An expensive producer (a dot) is never recomputed.
// CHECK-LABEL: func.func @main
// CHECK: %[[R:.*]] = call @a_fwd(%arg0)
// CHECK: call @b_fwd(%[[R]])
module {
  func.func @main(%arg0: tensor<4x4xf32>) -> tensor<4x4xf32> {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    return %1 : tensor<4x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<4x4xf32>) -> tensor<4x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = stablehlo.dot_general %arg0, %arg0, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    return %0 : tensor<4x4xf32>
  }
  func.func private @b_fwd(%arg0: tensor<4x4xf32>) -> tensor<4x4xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64}} {
    return %arg0 : tensor<4x4xf32>
  }
}

// -----

// The pass needs the MPMD form's @main.
// expected-error@+1 {{module has no 'main' function}}
module {
  func.func @not_main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    return %arg0 : tensor<4xf32>
  }
}
