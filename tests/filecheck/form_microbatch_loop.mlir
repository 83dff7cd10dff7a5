// RUN: mm-opt %s -p 'builtin.module(mm-form-microbatch-loop)' --split-input-file --verify-diagnostics | filecheck %s

// Two stages, two microbatches: the calls between the index and the sums move into
// @microbatch_loop, each sum is accumulated in place by the fragment that makes it
// (a donated running-sum argument plus an add), zeros come from one init fragment per
// task, and @main becomes: initialisers, the loop, what reads the sums.
// CHECK-LABEL: func.func @main(%arg0: tensor<4xf32>, %arg1: tensor<8x4xf32>)
// CHECK-NEXT: %[[ZB:.*]] = call @b_acc_init() {mm.fragment}
// CHECK-NEXT: %[[ZA:.*]] = call @a_acc_init() {mm.fragment}
// CHECK-NEXT: %[[LOOP:.*]]:2 = stablehlo.custom_call @mm.microbatch_loop(%[[ZB]], %[[ZA]], %arg1, %arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64}
// CHECK-NEXT: %[[U:.*]] = call @a_update(%arg0, %[[LOOP]]#1)
// CHECK-NEXT: return %[[LOOP]]#0, %[[LOOP]]#1, %[[U]]
// CHECK-NOT: mm.microbatch_sum
// CHECK-NOT: mm.microbatch_index
// CHECK-LABEL: func.func private @b_fwd
// CHECK-SAME: %arg1: tensor<f32> {jax.buffer_donor = true, sdy.sharding = #sdy.sharding<@mesh_b, []>}
// CHECK: %[[L:.*]] = stablehlo.reduce
// CHECK: %[[S:.*]] = stablehlo.add %arg1, %[[L]] : tensor<f32>
// CHECK-NEXT: return %[[S]], %{{.*}} : tensor<f32>, tensor<4x4xf32>
// CHECK-LABEL: func.func private @a_bwd
// CHECK-SAME: %arg2: tensor<4xf32> {jax.buffer_donor = true
// CHECK: %[[G:.*]] = stablehlo.reduce
// CHECK-NEXT: %[[T:.*]] = stablehlo.add %arg2, %[[G]] : tensor<4xf32>
// CHECK-NEXT: return %[[T]]
// The body: index, running sums, then the values it reads from outside.
// CHECK-LABEL: func.func private @microbatch_loop(%arg0: tensor<i32>, %arg1: tensor<f32>, %arg2: tensor<4xf32>, %arg3: tensor<8x4xf32>, %arg4: tensor<4xf32>) -> (tensor<f32>, tensor<4xf32>)
// CHECK-NEXT: %[[H:.*]] = call @a_fwd(%arg0, %arg3, %arg4) {mm.fragment}
// CHECK-NEXT: %[[B:.*]]:2 = call @b_fwd(%[[H]], %arg1) {mm.fragment}
// CHECK-NEXT: %[[A:.*]] = call @a_bwd(%[[B]]#1, %[[H]], %arg2) {mm.fragment}
// CHECK-NEXT: return %[[B]]#0, %[[A]]
// CHECK-LABEL: func.func private @b_acc_init() -> (tensor<f32> {sdy.sharding = #sdy.sharding<@mesh_b, []>})
// CHECK-SAME: mm.devices = [2, 3], mm.mesh = @mesh_b
// CHECK-NEXT: stablehlo.constant dense<0.000000e+00> : tensor<f32>
// CHECK-LABEL: func.func private @a_acc_init() -> (tensor<4xf32>
module {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%w: tensor<4xf32>, %x: tensor<8x4xf32>) -> (tensor<f32>, tensor<4xf32>, tensor<4xf32>) {
    %i = stablehlo.custom_call @mm.microbatch_index() {mm.loop = 0 : i64} : () -> tensor<i32>
    %h = call @a_fwd(%i, %x, %w) {mm.fragment} : (tensor<i32>, tensor<8x4xf32>, tensor<4xf32>) -> tensor<4x4xf32>
    %l:2 = call @b_fwd(%h) {mm.fragment} : (tensor<4x4xf32>) -> (tensor<f32>, tensor<4x4xf32>)
    %ls = stablehlo.custom_call @mm.microbatch_sum(%l#0) {mm.microbatch = {loop = 0 : i64, num_microbatches = 2 : i64}} : (tensor<f32>) -> tensor<f32>
    %g = call @a_bwd(%l#1, %h) {mm.fragment} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4xf32>
    %gs = stablehlo.custom_call @mm.microbatch_sum(%g) {mm.microbatch = {loop = 0 : i64, num_microbatches = 2 : i64}} : (tensor<4xf32>) -> tensor<4xf32>
    %u = call @a_update(%w, %gs) {mm.fragment} : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
    return %ls, %gs, %u : tensor<f32>, tensor<4xf32>, tensor<4xf32>
  }
  func.func private @a_fwd(%i: tensor<i32> {sdy.sharding = #sdy.sharding<@mesh_a, []>}, %x: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}, {}]>}, %w: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}) -> (tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    %c = stablehlo.constant dense<4> : tensor<i32>
    %o = stablehlo.multiply %i, %c : tensor<i32>
    %z = stablehlo.constant dense<0> : tensor<i32>
    %s = stablehlo.dynamic_slice %x, %o, %z, sizes = [4, 4] : (tensor<8x4xf32>, tensor<i32>, tensor<i32>) -> tensor<4x4xf32>
    %b = stablehlo.broadcast_in_dim %w, dims = [1] : (tensor<4xf32>) -> tensor<4x4xf32>
    %h = stablehlo.multiply %s, %b : tensor<4x4xf32>
    return %h : tensor<4x4xf32>
  }
  func.func private @b_fwd(%h: tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{"y"}, {}]>}) -> (tensor<f32> {sdy.sharding = #sdy.sharding<@mesh_b, []>}, tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{"y"}, {}]>}) attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, loop = 0 : i64}} {
    %s = stablehlo.sine %h : tensor<4x4xf32>
    %z = stablehlo.constant dense<0.0> : tensor<f32>
    %l = stablehlo.reduce(%s init: %z) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<f32>
    %c = stablehlo.cosine %h : tensor<4x4xf32>
    return %l, %c : tensor<f32>, tensor<4x4xf32>
  }
  func.func private @a_bwd(%c: tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}, %h: tensor<4x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) -> (tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, loop = 0 : i64}} {
    %m = stablehlo.multiply %c, %h : tensor<4x4xf32>
    %z = stablehlo.constant dense<0.0> : tensor<f32>
    %g = stablehlo.reduce(%m init: %z) applies stablehlo.add across dimensions = [0] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
    return %g : tensor<4xf32>
  }
  func.func private @a_update(%w: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}, %g: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}) -> (tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}]>}) attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %u = stablehlo.subtract %w, %g : tensor<4xf32>
    return %u : tensor<4xf32>
  }
}

// -----

// Without loop markers the module is left as it is.
// CHECK-LABEL: func.func @no_loop
// CHECK-NEXT: call @f(%arg0)
module {
  sdy.mesh @mesh = <["x"=1]>
  func.func @no_loop(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %0 = call @f(%arg0) {mm.fragment} : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
  func.func private @f(%arg0: tensor<4xf32>) -> tensor<4xf32> attributes {mm.devices = [0], mm.mesh = @mesh, mm.task = {name = "a", transpose_count = 0 : i64}} {
    return %arg0 : tensor<4xf32>
  }
  func.func @main() {
    return
  }
}

// -----

// A sum must read a result of a fragment in the loop.
module {
  sdy.mesh @mesh = <["x"=1]>
  func.func @main(%arg0: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
    %0 = call @f(%arg0) {mm.fragment} : (tensor<4xf32>) -> tensor<4xf32>
    %1 = stablehlo.custom_call @mm.microbatch_sum(%0) {mm.microbatch = {loop = 0 : i64, num_microbatches = 2 : i64}} : (tensor<4xf32>) -> tensor<4xf32>
    // expected-error@+1 {{'mm.microbatch_sum' must sum a result of a fragment call in the loop}}
    %2 = stablehlo.custom_call @mm.microbatch_sum(%arg0) {mm.microbatch = {loop = 0 : i64, num_microbatches = 2 : i64}} : (tensor<4xf32>) -> tensor<4xf32>
    return %1, %2 : tensor<4xf32>, tensor<4xf32>
  }
  func.func private @f(%arg0: tensor<4xf32>) -> tensor<4xf32> attributes {mm.devices = [0], mm.mesh = @mesh, mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<4xf32>
  }
}

// -----

// A value of the loop leaves it only through a sum.
module {
  sdy.mesh @mesh = <["x"=1]>
  func.func @main(%arg0: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
    %0 = call @f(%arg0) {mm.fragment} : (tensor<4xf32>) -> tensor<4xf32>
    %1 = stablehlo.custom_call @mm.microbatch_sum(%0) {mm.microbatch = {loop = 0 : i64, num_microbatches = 2 : i64}} : (tensor<4xf32>) -> tensor<4xf32>
    // expected-error@+1 {{'func.call' outside the microbatch loop reads a value of the loop directly}}
    %2 = call @g(%0) {mm.fragment} : (tensor<4xf32>) -> tensor<4xf32>
    return %1, %2 : tensor<4xf32>, tensor<4xf32>
  }
  func.func private @f(%arg0: tensor<4xf32>) -> tensor<4xf32> attributes {mm.devices = [0], mm.mesh = @mesh, mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<4xf32>
  }
  func.func private @g(%arg0: tensor<4xf32>) -> tensor<4xf32> attributes {mm.devices = [0], mm.mesh = @mesh, mm.task = {name = "a", transpose_count = 0 : i64}} {
    return %arg0 : tensor<4xf32>
  }
}

// -----

// The microbatch index exists only inside the loop: a call outside it cannot read it
// (found by IR fuzzing: the index op was erased under its reader).
module {
  sdy.mesh @mesh = <["x"=1]>
  func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %i = stablehlo.custom_call @mm.microbatch_index() {mm.loop = 0 : i64} : () -> tensor<i32>
    // expected-error@+1 {{'func.call' outside the microbatch loop reads the microbatch index 'mm.microbatch_index'}}
    %0 = call @f(%i, %arg0) {mm.fragment} : (tensor<i32>, tensor<4xf32>) -> tensor<4xf32>
    %1 = call @g(%0) {mm.fragment} : (tensor<4xf32>) -> tensor<4xf32>
    %2 = stablehlo.custom_call @mm.microbatch_sum(%1) {mm.microbatch = {loop = 0 : i64, num_microbatches = 2 : i64}} : (tensor<4xf32>) -> tensor<4xf32>
    return %2 : tensor<4xf32>
  }
  func.func private @f(%i: tensor<i32>, %arg0: tensor<4xf32>) -> tensor<4xf32> attributes {mm.devices = [0], mm.mesh = @mesh, mm.task = {name = "a", transpose_count = 0 : i64}} {
    return %arg0 : tensor<4xf32>
  }
  func.func private @g(%arg0: tensor<4xf32>) -> tensor<4xf32> attributes {mm.devices = [0], mm.mesh = @mesh, mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<4xf32>
  }
}

// -----

// Every sum of the loop agrees on the number of microbatches.
module {
  sdy.mesh @mesh = <["x"=1]>
  func.func @main(%arg0: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
    %0 = call @f(%arg0) {mm.fragment} : (tensor<4xf32>) -> tensor<4xf32>
    %1 = stablehlo.custom_call @mm.microbatch_sum(%0) {mm.microbatch = {loop = 0 : i64, num_microbatches = 2 : i64}} : (tensor<4xf32>) -> tensor<4xf32>
    // expected-error@+1 {{the loop's sums disagree on the number of microbatches (2 and 4)}}
    %2 = stablehlo.custom_call @mm.microbatch_sum(%0) {mm.microbatch = {loop = 0 : i64, num_microbatches = 4 : i64}} : (tensor<4xf32>) -> tensor<4xf32>
    return %1, %2 : tensor<4xf32>, tensor<4xf32>
  }
  func.func private @f(%arg0: tensor<4xf32>) -> tensor<4xf32> attributes {mm.devices = [0], mm.mesh = @mesh, mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<4xf32>
  }
}
