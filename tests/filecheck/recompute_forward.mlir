// RUN: mm-opt %s -p 'builtin.module(mm-recompute-forward{tasks=a})' --split-input-file --verify-diagnostics | filecheck %s
// RUN: mm-opt %s -p 'builtin.module(mm-recompute-forward{inputs-of=a})' --split-input-file --verify-diagnostics | filecheck %s --check-prefix=VIEWS
// RUN: mm-opt %s -p 'builtin.module(mm-recompute-forward{tasks={a,b},inputs-of=c},mm-split-backward{all=true})' --split-input-file --verify-diagnostics | filecheck %s --check-prefix=SPLIT

// @a_fwd keeps tanh(x @ w) and its slice of x for @a_bwd. With tasks=a the backward
// takes x and w instead and recomputes both (its input slice and its dot and tanh);
// @a_fwd then returns only what @b_fwd reads. With inputs-of=a (a task traced under
// jax.checkpoint) only the slice, a view of x, is re-read; the tanh stays a residual.
// CHECK-LABEL: func.func @main
// CHECK: %[[Y:.*]] = call @a_fwd(%arg0, %arg1) {mm.fragment} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
// CHECK: %[[G:.*]] = call @b_fwd(%[[Y]])
// CHECK: call @a_bwd(%[[G]], %arg0, %arg1) {mm.fragment}
// CHECK-LABEL: func.func private @a_fwd
// CHECK: return %{{.*}} : tensor<4x4xf32>
// CHECK-LABEL: func.func private @a_bwd
// CHECK-SAME: (%arg0: tensor<4x4xf32>, %arg1: tensor<8x4xf32>, %arg2: tensor<4x4xf32>)
// CHECK: %[[S:.*]] = stablehlo.slice %arg1
// CHECK: %[[D:.*]] = stablehlo.dot_general %[[S]], %arg2
// CHECK: %[[T:.*]] = stablehlo.tanh %[[D]]
// CHECK: stablehlo.multiply %arg0, %[[T]]
// VIEWS-LABEL: func.func @main
// VIEWS: %[[R:.*]]:2 = call @a_fwd(%arg0, %arg1) {mm.fragment} : (tensor<8x4xf32>, tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>)
// VIEWS: call @a_bwd(%{{.*}}, %[[R]]#1, %arg0) {mm.fragment}
// VIEWS-LABEL: func.func private @a_bwd
// VIEWS-NOT: stablehlo.tanh
// VIEWS: stablehlo.slice %arg2
module {
  func.func @main(%arg0: tensor<8x4xf32>, %arg1: tensor<4x4xf32>) -> (tensor<4x4xf32>) {
    %0:3 = call @a_fwd(%arg0, %arg1) {mm.fragment} : (tensor<8x4xf32>, tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>)
    %1 = call @b_fwd(%0#0) {mm.fragment} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %2 = call @a_bwd(%1, %0#1, %0#2) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    return %2 : tensor<4x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8x4xf32>, %arg1: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = stablehlo.slice %arg0 [0:4, 0:4] : (tensor<8x4xf32>) -> tensor<4x4xf32>
    %1 = stablehlo.dot_general %0, %arg1, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %2 = stablehlo.tanh %1 : tensor<4x4xf32>
    return %2, %2, %0 : tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>
  }
  func.func private @b_fwd(%arg0: tensor<4x4xf32>) -> tensor<4x4xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64}} {
    %0 = stablehlo.negate %arg0 : tensor<4x4xf32>
    return %0 : tensor<4x4xf32>
  }
  func.func private @a_bwd(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>, %arg2: tensor<4x4xf32>) -> tensor<4x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4x4xf32>
    %1 = stablehlo.dot_general %arg2, %0, contracting_dims = [0] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    return %1 : tensor<4x4xf32>
  }
}

// -----

// A zero-bubble split after the recompute: @b_bwd returns the cotangent @a_bwd reads
// (activation half) and b's weight gradient (weight half). The recomputed tanh is in
// the activation half only and crosses to the weight half as an argument: recomputed
// once, not once per half. A residual from another submesh (@a_fwd's #1, read by
// @b_bwd) is never recomputed.
// SPLIT-LABEL: func.func @main
// SPLIT: %[[A:.*]]:2 = call @a_fwd(%arg0, %arg1)
// SPLIT: %[[B:.*]] = call @b_fwd(%[[A]]#0, %arg2) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
// SPLIT: %[[ACT:.*]]:3 = call @b_bwd_act(%[[A]]#1, %[[A]]#0, %arg2)
// SPLIT: call @b_bwd_w(%[[ACT]]#1, %[[ACT]]#2)
// SPLIT-LABEL: func.func private @b_bwd_act
// SPLIT: stablehlo.dot_general %arg1, %arg2
// SPLIT: stablehlo.tanh
// SPLIT-NOT: stablehlo.tanh
// SPLIT-LABEL: func.func private @b_bwd_w
// SPLIT-NOT: stablehlo.tanh
// SPLIT: stablehlo.dot_general %arg0, %arg1
// SPLIT-NOT: stablehlo.tanh
module {
  func.func @main(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>, %arg2: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>) {
    %0:2 = call @a_fwd(%arg0, %arg1) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>)
    %1:2 = call @b_fwd(%0#0, %arg2) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>)
    %2:2 = call @b_bwd(%1#0, %1#1, %0#1) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>)
    %3 = call @a_bwd(%2#0, %arg1) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    return %3, %2#1, %1#0 : tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %1 = stablehlo.negate %0 : tensor<4x4xf32>
    return %0, %1 : tensor<4x4xf32>, tensor<4x4xf32>
  }
  func.func private @b_fwd(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>) attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64}} {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %1 = stablehlo.tanh %0 : tensor<4x4xf32>
    return %1, %1 : tensor<4x4xf32>, tensor<4x4xf32>
  }
  func.func private @b_bwd(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>, %arg2: tensor<4x4xf32>) -> (tensor<4x4xf32>, tensor<4x4xf32>) attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64}} {
    %0 = stablehlo.multiply %arg1, %arg2 : tensor<4x4xf32>
    %1 = stablehlo.dot_general %0, %arg1, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %2 = stablehlo.dot_general %arg1, %0, contracting_dims = [0] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    return %1, %2 : tensor<4x4xf32>, tensor<4x4xf32>
  }
  func.func private @a_bwd(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>) -> tensor<4x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4x4xf32>
    return %0 : tensor<4x4xf32>
  }
}
