// RUN: mm-opt %s -p 'builtin.module(mm-extract-fragments)' --split-input-file --verify-diagnostics | filecheck %s

// Each fragment becomes a nested module with its own mesh and a public @main free
// of mm.* attributes; calls become mm.fragment_call; transfers stay in @main.
// CHECK-LABEL: func.func @main
// CHECK: %[[A:.*]] = stablehlo.custom_call @mm.fragment_call(%arg0) {{.*}}mm.fragment = @a_fwd
// CHECK: %[[T:.*]] = stablehlo.custom_call @mm.transfer(%[[A]])
// CHECK: stablehlo.custom_call @mm.fragment_call(%[[T]]) {{.*}}mm.fragment = @b_fwd
// CHECK: module @a_fwd attributes
// CHECK-SAME: mhlo.num_partitions = 2 : i32
// CHECK-SAME: mm.devices = [0, 1]
// CHECK-NEXT: sdy.mesh @mesh_a = <["x"=2]>
// CHECK-NEXT: func.func public @main
// CHECK-NOT: mm.
// CHECK: module @b_fwd
module attributes {mm.num_devices = 8 : i64} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["x"=2]>
  func.func @main(%arg0: tensor<8x4xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) -> tensor<8x4xf32> {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    %1 = stablehlo.custom_call @mm.transfer(%0) {mm.devices = [2, 3], mm.sharding = #sdy.sharding<@mesh_b, [{"x"}, {}]>} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    %2 = call @b_fwd(%1) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    return %2 : tensor<8x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = stablehlo.sine %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<8x4xf32>
    return %0 : tensor<8x4xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{"x"}, {}]>}) -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{"x"}, {}]>}) attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8x4xf32>
    return %0 : tensor<8x4xf32>
  }
}

// -----

func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  // expected-error@+1 {{mm-extract-fragments expects a module in MPMD form, but this one is in front-end form (task calls not inlined yet, docs/ir.md section 1); run mm-inline-tasks, mm-outline-fragments and mm-propagate-shardings first}}
  %0 = call @f(%arg0) : (tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}
func.func private @f(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  return %arg0 : tensor<4xf32>
}

// -----

// A microbatch loop: the calls in its body become fragment calls too (the body stays a
// function of fragment calls and transfers); a running-sum argument keeps its
// jax.buffer_donor inside the nested module.
// CHECK-LABEL: func.func @main
// CHECK: stablehlo.custom_call @mm.microbatch_loop({{.*}}) {mm.body = @microbatch_loop
// CHECK: module @b_fwd
// CHECK: func.func public @main({{.*}}%arg1: tensor<f32> {jax.buffer_donor = true
// CHECK-LABEL: func.func private @microbatch_loop
// CHECK-NEXT: %[[A:.*]] = stablehlo.custom_call @mm.fragment_call(%arg0, %arg3, %arg4) {mm.fragment = @a_fwd}
// CHECK-NEXT: %[[T:.*]] = stablehlo.custom_call @mm.transfer(%[[A]])
// CHECK-NEXT: stablehlo.custom_call @mm.fragment_call(%[[T]], %arg1, %arg5) {mm.fragment = @b_fwd}
// CHECK-NOT: = call @
module {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<4xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh_a, [{}]>}, %arg1: tensor<8x4xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh_a, [{}, {}]>}) -> (tensor<f32>, tensor<4xf32>, tensor<4xf32>) {
    %0 = call @b_acc_init() {mm.fragment} : () -> tensor<f32>
    %1 = call @a_acc_init() {mm.fragment} : () -> tensor<4xf32>
    %2 = stablehlo.custom_call @mm.transfer(%arg0) {mm.devices = [2, 3], mm.sharding = #sdy.sharding<@mesh_b, [{}]>} : (tensor<4xf32>) -> tensor<4xf32>
    %3:2 = stablehlo.custom_call @mm.microbatch_loop(%0, %1, %arg1, %arg0, %2) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64} : (tensor<f32>, tensor<4xf32>, tensor<8x4xf32>, tensor<4xf32>, tensor<4xf32>) -> (tensor<f32>, tensor<4xf32>)
    %4 = call @a_update(%arg0, %3#1) {mm.fragment} : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
    return %3#0, %3#1, %4 : tensor<f32>, tensor<4xf32>, tensor<4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<i32> {sdy.sharding = #sdy.sharding<@mesh_a, []>}, %arg1: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}, {}]>}, %arg2: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}) -> (tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {loop = 0 : i64, name = "a", transpose_count = 0 : i64}} {
    %c = stablehlo.constant dense<4> : tensor<i32>
    %0 = stablehlo.multiply %arg0, %c : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %1 = stablehlo.dynamic_slice %arg1, %0, %c_0, sizes = [4, 4] : (tensor<8x4xf32>, tensor<i32>, tensor<i32>) -> tensor<4x4xf32>
    %2 = stablehlo.broadcast_in_dim %arg2, dims = [1] : (tensor<4xf32>) -> tensor<4x4xf32>
    %3 = stablehlo.multiply %1, %2 : tensor<4x4xf32>
    return %3 : tensor<4x4xf32>
  }
  func.func private @b_fwd(%arg0: tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{"y"}, {}]>}, %arg1: tensor<f32> {jax.buffer_donor = true, sdy.sharding = #sdy.sharding<@mesh_b, []>}, %arg2: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{}]>}) -> (tensor<f32> {sdy.sharding = #sdy.sharding<@mesh_b, []>}, tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{"y"}, {}]>}) attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {loop = 0 : i64, name = "b", transpose_count = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<4x4xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %1 = stablehlo.reduce(%0 init: %cst) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<f32>
    %2 = stablehlo.cosine %arg0 : tensor<4x4xf32>
    %3 = stablehlo.add %arg1, %1 : tensor<f32>
    return %3, %2 : tensor<f32>, tensor<4x4xf32>
  }
  func.func private @a_bwd(%arg0: tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}, %arg1: tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}, %arg2: tensor<4xf32> {jax.buffer_donor = true, sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}) -> (tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {loop = 0 : i64, name = "a", transpose_count = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4x4xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %1 = stablehlo.reduce(%0 init: %cst) applies stablehlo.add across dimensions = [0] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
    %2 = stablehlo.add %arg2, %1 : tensor<4xf32>
    return %2 : tensor<4xf32>
  }
  func.func private @a_update(%arg0: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}, %arg1: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}) -> (tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = stablehlo.subtract %arg0, %arg1 : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
  func.func private @microbatch_loop(%arg0: tensor<i32>, %arg1: tensor<f32>, %arg2: tensor<4xf32>, %arg3: tensor<8x4xf32>, %arg4: tensor<4xf32>, %arg5: tensor<4xf32>) -> (tensor<f32>, tensor<4xf32>) {
    %0 = call @a_fwd(%arg0, %arg3, %arg4) {mm.fragment} : (tensor<i32>, tensor<8x4xf32>, tensor<4xf32>) -> tensor<4x4xf32>
    %1 = stablehlo.custom_call @mm.transfer(%0) {mm.devices = [2, 3], mm.sharding = #sdy.sharding<@mesh_b, [{"y"}, {}]>} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %2:2 = call @b_fwd(%1, %arg1, %arg5) {mm.fragment} : (tensor<4x4xf32>, tensor<f32>, tensor<4xf32>) -> (tensor<f32>, tensor<4x4xf32>)
    %3 = stablehlo.custom_call @mm.transfer(%2#1) {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>} : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %4 = call @a_bwd(%3, %0, %arg2) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>, tensor<4xf32>) -> tensor<4xf32>
    return %2#0, %4 : tensor<f32>, tensor<4xf32>
  }
  func.func private @b_acc_init() -> (tensor<f32> {sdy.sharding = #sdy.sharding<@mesh_b, []>}) attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64}} {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    return %cst : tensor<f32>
  }
  func.func private @a_acc_init() -> (tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64}} {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<4xf32>
    return %cst : tensor<4xf32>
  }
}
