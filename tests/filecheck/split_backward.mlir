// RUN: mm-opt %s -p 'builtin.module(mm-split-backward{all=true})' --split-input-file --verify-diagnostics | filecheck %s
// RUN: mm-opt %s -p 'builtin.module(mm-split-backward)' --split-input-file --verify-diagnostics | filecheck %s --check-prefix=FLAGGED

// @b_bwd produces the cotangent @a_bwd needs (activation) and b's weight gradient.
// It splits into @b_bwd_act (the dot feeding @a_bwd, plus the shared tanh) and
// @b_bwd_w, which receives the shared intermediate as an extra argument. @a_bwd
// has no downstream backward, so it stays whole.
// CHECK-LABEL: func.func @main
// CHECK: %[[A:.*]]:2 = call @b_bwd_act(%arg1, %arg2) {mm.fragment}
// CHECK-NEXT: %[[W:.*]] = call @b_bwd_w(%arg2, %[[A]]#1) {mm.fragment}
// CHECK-NEXT: call @a_bwd(%[[A]]#0, %arg0) {mm.fragment}
// CHECK-LABEL: func.func private @b_bwd_act
// CHECK-SAME: mm.split = "activation"
// CHECK: stablehlo.tanh
// CHECK: stablehlo.dot_general
// CHECK-LABEL: func.func private @b_bwd_w
// CHECK-SAME: mm.split = "weight"
// CHECK-NOT: stablehlo.tanh
// CHECK: stablehlo.dot_general
// CHECK-LABEL: func.func private @a_bwd
// CHECK-NOT: mm.split
module {
  func.func @main(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>, %arg2: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>) {
    %0:2 = call @b_bwd(%arg1, %arg2) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>)
    %1 = call @a_bwd(%0#0, %arg0) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    return %1, %0#1 : tensor<4x4xf32>, tensor<4x4xf32>
  }
  func.func private @b_bwd(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>) attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, loop = 0 : i64}} {
    %0 = stablehlo.tanh %arg0 : tensor<4x4xf32>
    %1 = stablehlo.dot_general %0, %arg1, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %2 = stablehlo.dot_general %0, %arg1, contracting_dims = [0] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    return %1, %2 : tensor<4x4xf32>, tensor<4x4xf32>
  }
  func.func private @a_bwd(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>) -> tensor<4x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, loop = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4x4xf32>
    return %0 : tensor<4x4xf32>
  }
}

// -----

// Without all=true only tasks whose mm.tasks entry has split_backprop are split, and
// the halves take the task's suffixes.
// CHECK-LABEL: func.func @main
// CHECK: call @b_bwd_activations(
// FLAGGED-LABEL: func.func @main
// FLAGGED: call @b_bwd_activations(
// FLAGGED: call @b_bwd_gradients(
// FLAGGED: call @a_bwd(
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, b = {devices = [2, 3], axis_names = ["x"], axis_sizes = [2], logical_axes = [], split_backprop = ["_activations", "_gradients"]}}} {
  func.func @main(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>, %arg2: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>) {
    %0:2 = call @b_bwd(%arg1, %arg2) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>)
    %1 = call @a_bwd(%0#0, %arg0) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    return %1, %0#1 : tensor<4x4xf32>, tensor<4x4xf32>
  }
  func.func private @b_bwd(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>) attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64}} {
    %0 = stablehlo.tanh %arg0 : tensor<4x4xf32>
    %1 = stablehlo.dot_general %0, %arg1, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %2 = stablehlo.dot_general %0, %arg1, contracting_dims = [0] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    return %1, %2 : tensor<4x4xf32>, tensor<4x4xf32>
  }
  func.func private @a_bwd(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>) -> tensor<4x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4x4xf32>
    return %0 : tensor<4x4xf32>
  }
}

// -----

// The pass works on the MPMD form's @main.
// expected-error@+1 {{module has no 'main' function}}
module {
  func.func @other(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    return %arg0 : tensor<4xf32>
  }
}
