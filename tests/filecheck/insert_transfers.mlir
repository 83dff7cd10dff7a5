// RUN: mm-opt %s -p 'builtin.module(mm-insert-transfers)' --split-input-file --verify-diagnostics | filecheck %s

// A value produced on devices [0, 1] and consumed on [2, 3] gets one explicit
// transfer, placed right after its producer.
// CHECK-LABEL: func.func @main
// CHECK: %[[A:.*]] = call @a_fwd(%arg0)
// CHECK-NEXT: %[[T:.*]] = stablehlo.custom_call @mm.transfer(%[[A]])
// CHECK-SAME{LITERAL}: mm.devices = [2, 3], mm.sharding = #sdy.sharding<@mesh_b, [{"x"}, {}]>
// CHECK: call @b_fwd(%[[T]])
module attributes {mm.num_devices = 8 : i64} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["x"=2]>
  func.func @main(%arg0: tensor<8x4xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) -> tensor<8x4xf32> {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    return %1 : tensor<8x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8x4xf32>
    return %0 : tensor<8x4xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{"x"}, {}]>}) -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{"x"}, {}]>}) attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8x4xf32>
    return %0 : tensor<8x4xf32>
  }
}

// -----

// Same devices and same layout (forward to backward of one task): no transfer.
// A program input wanted in two layouts is placed for its first consumer and
// transferred once for the other.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[T:.*]] = stablehlo.custom_call @mm.transfer(%arg0)
// CHECK-SAME{LITERAL}: mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh_a, [{}, {}]>
// CHECK-NEXT: %[[F:.*]] = call @a_fwd(%arg0)
// CHECK-NOT: mm.transfer
// CHECK: call @a_bwd(%[[F]], %[[T]])
module attributes {mm.num_devices = 8 : i64} {
  sdy.mesh @mesh_a = <["x"=2]>
  func.func @main(%arg0: tensor<8x4xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) -> tensor<8x4xf32> {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    %1 = call @a_bwd(%0, %arg0) {mm.fragment} : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
    return %1 : tensor<8x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8x4xf32>
    return %0 : tensor<8x4xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}, %arg1: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}, {}]>}) -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8x4xf32>
    return %0 : tensor<8x4xf32>
  }
}

// -----

module attributes {mm.num_devices = 8 : i64} {
  sdy.mesh @mesh_a = <["x"=2]>
  func.func @main(%arg0: tensor<8x4xf32>) -> tensor<8x4xf32> {
    // expected-error@+1 {{fragment '@a_fwd' argument #0 has no sdy.sharding; run mm-propagate-shardings first}}
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    return %0 : tensor<8x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8x4xf32>) -> tensor<8x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    return %arg0 : tensor<8x4xf32>
  }
}
