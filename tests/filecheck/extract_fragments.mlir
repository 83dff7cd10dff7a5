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
