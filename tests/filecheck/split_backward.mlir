// RUN: mm-opt %s -p 'builtin.module(mm-split-backward{all=true})' --split-input-file --verify-diagnostics | filecheck %s
// RUN: mm-opt %s -p 'builtin.module(mm-split-backward)' --split-input-file --verify-diagnostics | filecheck %s --check-prefix=FLAGGED
// RUN: mm-opt %s -p 'builtin.module(mm-split-backward{all=true recompute=d})' --split-input-file --verify-diagnostics | filecheck %s --check-prefix=RECOMPUTE

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

// -----

// recompute=d: @d_bwd's activation half makes three values its weight half reads
// (tanh x, tanh(tanh x . w), the cotangent through it: 192 bytes); recomputing them
// from the backward's own arguments keeps x and g (made by other fragments, 128
// bytes) alive instead, so the weight half recomputes and takes no extra arguments.
// Without the option the weight half takes the three shared values.
// CHECK-LABEL: func.func @main
// CHECK: %[[A:.*]]:4 = call @d_bwd_act(%[[X:.*]], %{{.*}}, %[[G:.*]]) {mm.fragment}
// CHECK: call @d_bwd_w(%[[A]]#1, %[[A]]#2, %[[A]]#3) {mm.fragment}
// RECOMPUTE-LABEL: func.func @main
// RECOMPUTE: %[[X:.*]] = call @c_fwd(
// RECOMPUTE: %[[G:.*]] = call @e_bwd(
// RECOMPUTE: %[[A:.*]] = call @d_bwd_act(%[[X]], %arg1, %[[G]]) {mm.fragment}
// RECOMPUTE-NEXT: call @d_bwd_w(%[[X]], %arg1, %[[G]]) {mm.fragment}
// RECOMPUTE-LABEL: func.func private @d_bwd_act
// RECOMPUTE: stablehlo.tanh
// RECOMPUTE-LABEL: func.func private @d_bwd_w
// RECOMPUTE-SAME: mm.split = "weight"
// RECOMPUTE: stablehlo.tanh
// RECOMPUTE: stablehlo.tanh
// RECOMPUTE: stablehlo.dot_general
module {
  func.func @main(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>) {
    %x = call @c_fwd(%arg0) {mm.fragment} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %g = call @e_bwd(%arg0) {mm.fragment} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %0:2 = call @d_bwd(%x, %arg1, %g) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>)
    %1 = call @c_bwd(%0#0) {mm.fragment} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    return %1, %0#1 : tensor<4x4xf32>, tensor<4x4xf32>
  }
  func.func private @c_fwd(%arg0: tensor<4x4xf32>) -> tensor<4x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "c", transpose_count = 0 : i64, loop = 0 : i64}} {
    %0 = stablehlo.negate %arg0 : tensor<4x4xf32>
    return %0 : tensor<4x4xf32>
  }
  func.func private @e_bwd(%arg0: tensor<4x4xf32>) -> tensor<4x4xf32> attributes {mm.devices = [4, 5], mm.mesh = @mesh_c, mm.task = {name = "e", transpose_count = 1 : i64, loop = 0 : i64}} {
    %0 = stablehlo.negate %arg0 : tensor<4x4xf32>
    return %0 : tensor<4x4xf32>
  }
  func.func private @d_bwd(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>, %arg2: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>) attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "d", transpose_count = 1 : i64, loop = 0 : i64}} {
    %0 = stablehlo.tanh %arg0 : tensor<4x4xf32>
    %1 = stablehlo.dot_general %0, %arg1, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %2 = stablehlo.tanh %1 : tensor<4x4xf32>
    %3 = stablehlo.multiply %arg2, %2 : tensor<4x4xf32>
    %4 = stablehlo.dot_general %3, %arg1, contracting_dims = [1] x [1] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %5 = stablehlo.dot_general %0, %3, contracting_dims = [0] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %6 = stablehlo.add %5, %2 : tensor<4x4xf32>
    return %4, %6 : tensor<4x4xf32>, tensor<4x4xf32>
  }
  func.func private @c_bwd(%arg0: tensor<4x4xf32>) -> tensor<4x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "c", transpose_count = 1 : i64, loop = 0 : i64}} {
    %0 = stablehlo.negate %arg0 : tensor<4x4xf32>
    return %0 : tensor<4x4xf32>
  }
}
