// RUN: mm-opt %s -p 'builtin.module(mm-merge-fragments)' --split-input-file --verify-diagnostics | filecheck %s
// RUN: mm-opt %s -p 'builtin.module(mm-merge-fragments{scope=all})' --split-input-file --verify-diagnostics | filecheck %s --check-prefix=ALL

// One submesh: the forward and the backward become one fragment. Its arguments are
// the run's outside operands (the weight once, though both halves read it), its
// results only what is used after the run: the residual %0#1 stays inside.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[M:.*]]:2 = call @s_fwd_bwd(%arg0, %arg1) {mm.fragment}
// CHECK-NEXT: return %[[M]]#0, %[[M]]#1
// CHECK-NOT: func.func private @s_fwd(
// CHECK-LABEL: func.func private @s_fwd_bwd(
// CHECK-SAME: %arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}
// CHECK-SAME: %arg1: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}
// CHECK-SAME: -> (tensor<f32> {sdy.sharding = #sdy.sharding<@mesh, []>}, tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>})
// CHECK-SAME: mm.devices = [0, 1], mm.mesh = @mesh, mm.task = {name = "s", transpose_count = 1 : i64}
// CHECK-NEXT: %[[T:.*]] = stablehlo.tanh %arg0
// CHECK: %[[S:.*]] = stablehlo.reduce
// CHECK: %[[G:.*]] = stablehlo.multiply %[[T]], %arg1
// CHECK-NEXT: return %[[S]], %[[G]]
// CHECK-NOT: func.func private @s_bwd(
// ALL-LABEL: func.func @main
// ALL-NEXT: call @s_fwd_bwd(%arg0, %arg1) {mm.fragment}
module attributes {mm.num_devices = 2 : i64} {
  sdy.mesh @mesh = <["x"=2]>
  func.func @main(%arg0: tensor<8x8xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}, %arg1: tensor<8x8xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<f32>, tensor<8x8xf32>) {
    %0:2 = call @s_fwd(%arg0, %arg1) {mm.fragment} : (tensor<8x8xf32>, tensor<8x8xf32>) -> (tensor<f32>, tensor<8x8xf32>)
    %1 = call @s_bwd(%0#1, %arg1) {mm.fragment} : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
    return %0#0, %1 : tensor<f32>, tensor<8x8xf32>
  }
  func.func private @s_fwd(%arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}, %arg1: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<f32> {sdy.sharding = #sdy.sharding<@mesh, []>}, tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh, mm.task = {name = "s", transpose_count = 0 : i64}} {
    %0 = stablehlo.tanh %arg0 : tensor<8x8xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %1 = stablehlo.reduce(%0 init: %cst) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x8xf32>, tensor<f32>) -> tensor<f32>
    return %1, %0 : tensor<f32>, tensor<8x8xf32>
  }
  func.func private @s_bwd(%arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}, %arg1: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh, mm.task = {name = "s", transpose_count = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}

// -----

// Two submeshes: by default nothing merges. With scope=all, a's two fragments merge
// (their run ends at b, on other devices); b and c (two tasks on one submesh) merge
// too, b's result used inside and returned; a value handed over in another sharding
// (a reshard) ends a run: c_bwd stays a call of its own.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: call @a_fwd(
// CHECK-NEXT: call @a_bwd(
// CHECK-NEXT: call @b_fwd(
// CHECK-NEXT: call @c_fwd(
// CHECK-NEXT: call @c_bwd(
// ALL-LABEL: func.func @main
// ALL-NEXT: %[[A:.*]] = call @a_fwd_bwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
// ALL-NEXT: %[[B:.*]]:2 = call @b_fwd__c_fwd(%[[A]]) {mm.fragment} : (tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>)
// ALL-NEXT: %[[C:.*]] = call @c_bwd(%[[B]]#1)
// ALL-NEXT: return %[[B]]#0, %[[C]]
// ALL-NOT: func.func private @a_fwd(
// ALL-LABEL: func.func private @a_fwd_bwd(
// ALL-SAME: mm.devices = [0, 1]
// ALL-NEXT: stablehlo.sine %arg0
// ALL-NEXT: stablehlo.cosine
module attributes {mm.num_devices = 4 : i64} {
  sdy.mesh @mesh = <["x"=2]>
  func.func @main(%arg0: tensor<8xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @a_bwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_fwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @c_fwd(%2) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %4 = call @c_bwd(%3) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    return %2, %4 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh, mm.task = {name = "a", transpose_count = 1 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) attributes {mm.devices = [2, 3], mm.mesh = @mesh, mm.task = {name = "b", transpose_count = 0 : i64}} {
    %0 = stablehlo.negate %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @c_fwd(%arg0: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>}) attributes {mm.devices = [2, 3], mm.mesh = @mesh, mm.task = {name = "c", transpose_count = 0 : i64}} {
    %0 = stablehlo.abs %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @c_bwd(%arg0: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) attributes {mm.devices = [2, 3], mm.mesh = @mesh, mm.task = {name = "c", transpose_count = 1 : i64}} {
    %0 = stablehlo.exponential %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// A microbatch loop on one submesh under GPipe (F0 F1 B0 B1): the body's forward and
// backward merge, the running sum keeps its donation, and the schedule's order is
// rewritten for the merged body: each microbatch where its backward ran.
// CHECK-LABEL: func.func @main
// CHECK: mm.schedule = {name = "gpipe", order = array<i64: 0, 0, 0, 1>}
// CHECK-LABEL: func.func private @microbatch_loop
// CHECK-NEXT: %[[R:.*]] = call @s_fwd_bwd(%arg2, %arg1) {mm.fragment}
// CHECK-NEXT: return %[[R]]
// CHECK-LABEL: func.func private @s_fwd_bwd(
// CHECK-SAME: %arg1: tensor<8xf32> {jax.buffer_donor = true}
// CHECK-SAME: mm.task = {loop = 0 : i64, name = "s", transpose_count = 0 : i64}
// ALL-LABEL: func.func @main
// ALL: mm.schedule = {name = "gpipe", order = array<i64: 0, 0, 0, 1>}
module attributes {mm.num_devices = 2 : i64} {
  func.func @main(%arg0: tensor<8xf32> {mm.devices = [0, 1]}) -> tensor<8xf32> {
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0, %arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64, mm.schedule = {name = "gpipe", order = array<i64: 0, 0, 0, 1, 1, 0, 1, 1>}} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @microbatch_loop(%i: tensor<i32>, %acc: tensor<8xf32>, %x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @s_fwd(%x) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @s_bwd(%0, %acc) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @s_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "s", transpose_count = 0 : i64, loop = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @s_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32> {jax.buffer_donor = true}) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "s", transpose_count = 1 : i64, loop = 0 : i64}} {
    %0 = stablehlo.add %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// Two submeshes under 1F1B, scope=all: the last stage's forward and backward run
// back to back on their submesh for every microbatch, so they merge, and b's merged
// call takes its backward's place; a's forward and backward do not (the schedule runs
// b between them, reading a's forward).
// ALL-LABEL: func.func @main
// ALL: mm.schedule = {name = "1f1b", order = array<i64: 0, 0, 0, 1, 1, 0, 2, 0, 1, 1, 2, 1>}
// ALL-LABEL: func.func private @microbatch_loop
// ALL-NEXT: call @a_fwd(
// ALL-NEXT: call @b_fwd_bwd(
// ALL-NEXT: call @a_bwd(
// CHECK-LABEL: func.func private @microbatch_loop
// CHECK-NEXT: call @a_fwd(
// CHECK-NEXT: call @b_fwd(
// CHECK-NEXT: call @b_bwd(
// CHECK-NEXT: call @a_bwd(
module attributes {mm.num_devices = 4 : i64} {
  func.func @main(%arg0: tensor<8xf32> {mm.devices = [0, 1]}) -> tensor<8xf32> {
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0, %arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64, mm.schedule = {name = "1f1b", order = array<i64: 0, 0, 0, 1, 1, 0, 2, 0, 3, 0, 1, 1, 2, 1, 3, 1>}} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @microbatch_loop(%i: tensor<i32>, %acc: tensor<8xf32>, %x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @a_fwd(%x) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0, %acc) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3 : tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>, %arg2: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
}

// -----

// The same loop under GPipe, scope=all: b runs its second forward between its first
// forward and backward (b: F0 F1 B0 B1), so merging would reorder b's calls: nothing
// merges and the order stands.
// ALL-LABEL: func.func @main
// ALL: mm.schedule = {name = "gpipe", order = array<i64: 0, 0, 0, 1, 1, 0, 1, 1, 2, 0, 3, 0, 2, 1, 3, 1>}
// ALL-LABEL: func.func private @microbatch_loop
// ALL-NEXT: call @a_fwd(
// ALL-NEXT: call @b_fwd(
// ALL-NEXT: call @b_bwd(
// ALL-NEXT: call @a_bwd(
// CHECK-LABEL: func.func private @microbatch_loop
// CHECK-NEXT: call @a_fwd(
// CHECK-NEXT: call @b_fwd(
module attributes {mm.num_devices = 4 : i64} {
  func.func @main(%arg0: tensor<8xf32> {mm.devices = [0, 1]}) -> tensor<8xf32> {
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0, %arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64, mm.schedule = {name = "gpipe", order = array<i64: 0, 0, 0, 1, 1, 0, 1, 1, 2, 0, 3, 0, 2, 1, 3, 1>}} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @microbatch_loop(%i: tensor<i32>, %acc: tensor<8xf32>, %x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @a_fwd(%x) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0, %acc) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3 : tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>, %arg2: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
}
