// RUN: mm-opt %s -p 'builtin.module(mm-strip-markers)' --split-input-file --verify-diagnostics | filecheck %s

// Markers become their operand; task attributes on calls disappear.
// CHECK-LABEL: func @task_and_marker
// CHECK-SAME: (%[[ARG:.*]]: tensor<8x8xf32>)
func.func @task_and_marker(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
  // CHECK-NOT: mm.logical_sharding
  %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"], []]} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  // CHECK: %[[CALL:.*]] = call @body(%[[ARG]]) : (tensor<8x8xf32>) -> tensor<8x8xf32>
  %1 = func.call @body(%0) {mm.task = {name = "layer1", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch", "x"]]}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  // CHECK: return %[[CALL]]
  return %1 : tensor<8x8xf32>
}
func.func private @body(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
  return %arg0 : tensor<8x8xf32>
}

// -----

// Module-level, op-level and argument-level mm.* attributes go; others stay.
// CHECK-NOT: mm.tasks
// CHECK-LABEL: func @flat_form
// CHECK-SAME: (%arg0: tensor<8xf32> {jax.keep = true}, %arg1: tensor<8xf32>) -> (tensor<8xf32> {jax.result_info = "out"})
module attributes {mm.tasks = {a = {devices = [0], axis_names = ["x"], axis_sizes = [1]}}} {
  func.func @flat_form(%arg0: tensor<8xf32> {jax.keep = true, mm.sharded = 1 : i64}, %arg1: tensor<8xf32> {mm.sharded = 0 : i64}) -> (tensor<8xf32> {jax.result_info = "out", mm.out = 1 : i64}) {
    // CHECK: stablehlo.add %arg0, %arg1 {other = 1 : i64} : tensor<8xf32>
    %0 = stablehlo.add %arg0, %arg1 {mm.task = {name = "a", transpose_count = 0 : i64}, other = 1 : i64} : tensor<8xf32>
    // CHECK-NOT: mm.
    return %0 : tensor<8xf32>
  }
}

// -----

// Markers nested in regions (a scan body) are removed too.
// CHECK-LABEL: func @nested
func.func @nested(%arg0: tensor<i32>) -> tensor<i32> {
  // CHECK: stablehlo.while
  %0 = stablehlo.while(%iter = %arg0) : tensor<i32>
  cond {
    %c = stablehlo.constant dense<10> : tensor<i32>
    %p = stablehlo.compare LT, %iter, %c : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    // CHECK-NOT: mm.logical_sharding
    %m = stablehlo.custom_call @mm.logical_sharding(%iter) {mm.axes = []} : (tensor<i32>) -> tensor<i32>
    // CHECK: stablehlo.add %[[ITER:.*]], %[[ITER]]
    %n = stablehlo.add %m, %m : tensor<i32>
    stablehlo.return %n : tensor<i32>
  }
  return %0 : tensor<i32>
}

// -----

// mm.transfer is an identity too; other custom calls are kept.
// CHECK-LABEL: func @other_custom_calls
func.func @other_custom_calls(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // CHECK: %[[S:.*]] = stablehlo.custom_call @Sharding(%arg0)
  %0 = stablehlo.custom_call @Sharding(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
  // CHECK-NOT: mm.transfer
  %1 = stablehlo.custom_call @mm.transfer(%0) {mm.dst = "mesh_b"} : (tensor<8xf32>) -> tensor<8xf32>
  // CHECK: return %[[S]]
  return %1 : tensor<8xf32>
}

// -----

func.func @error_marker_operands(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.logical_sharding' must have exactly one operand and one result, got 2 and 1}}
  %0 = stablehlo.custom_call @mm.logical_sharding(%arg0, %arg0) {mm.axes = [[]]} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

func.func @error_transfer_operands(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.transfer' must have exactly one operand and one result, got 0 and 1}}
  %0 = stablehlo.custom_call @mm.transfer() : () -> tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

func.func @error_marker_type(%arg0: tensor<8xf32>) -> tensor<8xi32> {
  // expected-error@+1 {{'mm.logical_sharding' result type tensor<8xi32> differs from operand type tensor<8xf32>}}
  %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [[]]} : (tensor<8xf32>) -> tensor<8xi32>
  return %0 : tensor<8xi32>
}
