// RUN: mm-opt %s -p 'builtin.module(mm-propagate-shardings)' --split-input-file --verify-diagnostics | filecheck %s

// Each fragment is propagated alone on its mesh; its arguments and results get
// closed sdy.sharding, and the @main argument gets mm.sharding (the layout of its
// first consumer). The value a_fwd hands to b_fwd lives on an equally shaped mesh
// (["x"=2]), so b_fwd starts from a's layout rebased onto @mesh_b, though nothing
// in b_fwd constrains it.
// CHECK-LABEL: func.func @main
// CHECK-SAME: (%arg0: tensor<8x4xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) -> tensor<8x4xf32>
// CHECK-NEXT: call @a_fwd(%arg0) {mm.fragment}
// CHECK-NEXT: call @b_fwd
// CHECK-LABEL: func.func private @a_fwd
// CHECK-SAME: (%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>})
// CHECK-SAME: attributes {mm.devices = [0, 1], mm.mesh = @mesh_a
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_a, [{"x"}, {}]>
// CHECK-NEXT: stablehlo.sine
// CHECK-LABEL: func.func private @b_fwd
// CHECK-SAME: (%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{"x"}, {}]>}) -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{"x"}, {}]>})
// CHECK-NEXT: stablehlo.cosine %arg0 : tensor<8x4xf32>
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, b = {devices = [2, 3], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["x"=2]>
  func.func @main(%arg0: tensor<8x4xf32>) -> tensor<8x4xf32> {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    return %1 : tensor<8x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8x4xf32>) -> tensor<8x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = sdy.sharding_constraint %arg0 <@mesh_a, [{"x"}, {}]> : tensor<8x4xf32>
    %1 = stablehlo.sine %0 : tensor<8x4xf32>
    return %1 : tensor<8x4xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8x4xf32>) -> tensor<8x4xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8x4xf32>
    return %0 : tensor<8x4xf32>
  }
}

// -----

// Meshes of different shapes (["x"=2] vs ["y"=4]): the handed-over value does not
// keep a's layout; b_fwd's own constraint on %arg1 propagates through the add to
// its other argument and its result. Each @main argument gets its consumer's layout.
// CHECK-LABEL: func.func @main
// CHECK-SAME: (%arg0: tensor<8x4xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}, %arg1: tensor<8x4xf32> {mm.devices = [2, 3, 4, 5], mm.sharding = #sdy.sharding<@mesh_b, [{}, {"y"}]>})
// CHECK-LABEL: func.func private @a_fwd
// CHECK-SAME: (%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>})
// CHECK-LABEL: func.func private @b_fwd
// CHECK-SAME: (%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{}, {"y"}]>}, %arg1: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{}, {"y"}]>}) -> (tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{}, {"y"}]>})
// CHECK-SAME: attributes {mm.devices = [2, 3, 4, 5], mm.mesh = @mesh_b
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, b = {devices = [2, 3, 4, 5], axis_names = ["y"], axis_sizes = [4], logical_axes = []}}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=4]>
  func.func @main(%arg0: tensor<8x4xf32>, %arg1: tensor<8x4xf32>) -> tensor<8x4xf32> {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    %1 = call @b_fwd(%0, %arg1) {mm.fragment} : (tensor<8x4xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
    return %1 : tensor<8x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8x4xf32>) -> tensor<8x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = sdy.sharding_constraint %arg0 <@mesh_a, [{"x"}, {}]> : tensor<8x4xf32>
    %1 = stablehlo.sine %0 : tensor<8x4xf32>
    return %1 : tensor<8x4xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8x4xf32>, %arg1: tensor<8x4xf32>) -> tensor<8x4xf32> attributes {mm.devices = [2, 3, 4, 5], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64}} {
    %0 = sdy.sharding_constraint %arg1 <@mesh_b, [{}, {"y"}]> : tensor<8x4xf32>
    %1 = stablehlo.add %arg0, %0 : tensor<8x4xf32>
    return %1 : tensor<8x4xf32>
  }
}

// -----

// The pass needs the MPMD form's @main.
// expected-error@+1 {{module has no 'main' function}}
module {
  sdy.mesh @mesh_a = <["x"=2]>
  func.func @f(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    return %arg0 : tensor<8xf32>
  }
}

// -----

// A pinned @main argument (a physical input sharding the caller gave) keeps its
// mm.sharding/mm.devices. a_fwd runs on the same devices with a mesh that can express
// the layout (["d"=4] rows = ["x"=4, "y"=1] rows), so it reads the input in place;
// b_fwd's devices differ, so it starts from its own layout (a transfer follows).
// CHECK-LABEL: func.func @main
// CHECK-SAME: (%arg0: tensor<8x4xf32> {mm.devices = [0, 1, 2, 3], mm.sharding = #sdy.sharding<mesh<["d"=4]>, [{"d"}, {}]>})
// CHECK-LABEL: func.func private @a_fwd
// CHECK-SAME: (%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>})
// CHECK-LABEL: func.func private @b_fwd
// CHECK-SAME: (%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_b, [{}, {}]>})
module attributes {mm.tasks = {a = {devices = [0, 1, 2, 3], axis_names = ["x", "y"], axis_sizes = [4, 1], logical_axes = []}, b = {devices = [4, 5, 6, 7], axis_names = ["x", "y"], axis_sizes = [4, 1], logical_axes = []}}} {
  sdy.mesh @mesh_a = <["x"=4, "y"=1]>
  sdy.mesh @mesh_b = <["x"=4, "y"=1]>
  func.func @main(%arg0: tensor<8x4xf32> {mm.devices = [0, 1, 2, 3], mm.sharding = #sdy.sharding<mesh<["d"=4]>, [{"d"}, {}]>}) -> (tensor<8x4xf32>, tensor<8x4xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    %1 = call @b_fwd(%arg0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    return %0, %1 : tensor<8x4xf32>, tensor<8x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8x4xf32>) -> tensor<8x4xf32> attributes {mm.devices = [0, 1, 2, 3], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8x4xf32>
    return %0 : tensor<8x4xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8x4xf32>) -> tensor<8x4xf32> attributes {mm.devices = [4, 5, 6, 7], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8x4xf32>
    return %0 : tensor<8x4xf32>
  }
}

// -----

// A constraint over an axis that does not divide its dimension (5 rows over "x"=2)
// stays inside the fragment, where XLA pads as for jax.jit; the fragment's arguments
// and results, which XLA never pads, take the longest dividing prefix (replicated
// here), and so does the @main argument.
// CHECK-LABEL: func.func @main
// CHECK-SAME: (%arg0: tensor<5x4xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<@mesh_a, [{}, {}]>})
// CHECK-LABEL: func.func private @a_fwd
// CHECK-SAME: (%arg0: tensor<5x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}, {}]>}) -> (tensor<5x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}, {}]>})
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_a, [{"x"}, {}]>
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  sdy.mesh @mesh_a = <["x"=2]>
  func.func @main(%arg0: tensor<5x4xf32>) -> tensor<5x4xf32> {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<5x4xf32>) -> tensor<5x4xf32>
    return %0 : tensor<5x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<5x4xf32>) -> tensor<5x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = sdy.sharding_constraint %arg0 <@mesh_a, [{"x"}, {}]> : tensor<5x4xf32>
    %1 = stablehlo.sine %0 : tensor<5x4xf32>
    return %1 : tensor<5x4xf32>
  }
}

// -----

// A batch whose rows are sharded over "x" (here pinned by the caller), cut by the
// microbatch loop into 4 microbatches of 2 rows: microbatch %i, rows [2i, 2i + 2), lies
// on one shard, and slicing it out would gather the batch onto both devices. Instead
// the batch is split once, before the loop: @a_microbatches reshapes its 8 rows into
// 4 x 2 with "x" on the 2 rows of each microbatch, and a_fwd picks microbatch %i along
// the unsharded dimension, so its propagation starts from rows split over "x" and its
// result keeps them so. The multiply that made the row offset is gone.
// CHECK-LABEL: func.func @main
// CHECK-SAME: (%arg0: tensor<8x4xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<mesh<["x"=2]>, [{"x"}, {}]>})
// CHECK: %[[I:.*]] = stablehlo.custom_call @mm.microbatch_index()
// CHECK-NEXT: %[[S:.*]] = call @a_microbatches(%arg0) {mm.fragment} : (tensor<8x4xf32>) -> tensor<4x2x4xf32>
// CHECK-NEXT: call @a_fwd(%[[I]], %[[S]]) {mm.fragment}
// CHECK-LABEL: func.func private @a_microbatches
// CHECK-SAME: (%arg0: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}) -> (tensor<4x2x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}, {"x"}, {}]>})
// CHECK-SAME: attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.reshape %arg0 : (tensor<8x4xf32>) -> tensor<4x2x4xf32>
// CHECK-LABEL: func.func private @a_fwd
// CHECK-SAME: %arg1: tensor<4x2x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{}, {"x"}, {}]>}
// CHECK-SAME: -> (tensor<2x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>})
// CHECK-NOT: stablehlo.multiply
// CHECK: stablehlo.dynamic_slice %arg1, %arg0, %{{.*}}, %{{.*}}, sizes = [1, 2, 4]
// CHECK-NEXT: stablehlo.reshape %{{.*}} : (tensor<1x2x4xf32>) -> tensor<2x4xf32>
// CHECK-NEXT: stablehlo.sine
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  sdy.mesh @mesh_a = <["x"=2]>
  func.func @main(%arg0: tensor<8x4xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<mesh<["x"=2]>, [{"x"}, {}]>}) -> tensor<2x4xf32> {
    %0 = stablehlo.custom_call @mm.microbatch_index() {mm.loop = 0 : i64} : () -> tensor<i32>
    %1 = call @a_fwd(%0, %arg0) {mm.fragment} : (tensor<i32>, tensor<8x4xf32>) -> tensor<2x4xf32>
    %2 = stablehlo.custom_call @mm.microbatch_sum(%1) {mm.microbatch = {loop = 0 : i64, num_microbatches = 4 : i64}} : (tensor<2x4xf32>) -> tensor<2x4xf32>
    return %2 : tensor<2x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<i32>, %arg1: tensor<8x4xf32>) -> tensor<2x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    %c = stablehlo.constant dense<2> : tensor<i32>
    %0 = stablehlo.multiply %arg0, %c : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %1 = stablehlo.dynamic_slice %arg1, %0, %c_0, sizes = [2, 4] : (tensor<8x4xf32>, tensor<i32>, tensor<i32>) -> tensor<2x4xf32>
    %2 = stablehlo.sine %1 : tensor<2x4xf32>
    return %2 : tensor<2x4xf32>
  }
}

// -----

// A microbatch of one row cannot be split over the 2 devices of "x": the fragment
// keeps slicing the batch as it is (no split fragment), and the pass says so.
// CHECK-LABEL: func.func @main
// CHECK-NOT: @a_microbatches
// CHECK-LABEL: func.func private @a_fwd
// CHECK-SAME: %arg1: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh_a, [{"x"}, {}]>}
// CHECK: stablehlo.multiply
// CHECK: stablehlo.dynamic_slice %arg1, %{{.*}}, %{{.*}}, sizes = [1, 4]
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  sdy.mesh @mesh_a = <["x"=2]>
  func.func @main(%arg0: tensor<8x4xf32> {mm.devices = [0, 1], mm.sharding = #sdy.sharding<mesh<["x"=2]>, [{"x"}, {}]>}) -> tensor<1x4xf32> {
    %0 = stablehlo.custom_call @mm.microbatch_index() {mm.loop = 0 : i64} : () -> tensor<i32>
    // expected-warning@+1 {{the microbatches of 1 row cannot be split over mesh axes 'x' (2 devices) of task 'a', which shard the batch's dimension 0}}
    %1 = call @a_fwd(%0, %arg0) {mm.fragment} : (tensor<i32>, tensor<8x4xf32>) -> tensor<1x4xf32>
    %2 = stablehlo.custom_call @mm.microbatch_sum(%1) {mm.microbatch = {loop = 0 : i64, num_microbatches = 8 : i64}} : (tensor<1x4xf32>) -> tensor<1x4xf32>
    return %2 : tensor<1x4xf32>
  }
  func.func private @a_fwd(%arg0: tensor<i32>, %arg1: tensor<8x4xf32>) -> tensor<1x4xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    %c = stablehlo.constant dense<1> : tensor<i32>
    %0 = stablehlo.multiply %arg0, %c : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %1 = stablehlo.dynamic_slice %arg1, %0, %c_0, sizes = [1, 4] : (tensor<8x4xf32>, tensor<i32>, tensor<i32>) -> tensor<1x4xf32>
    %2 = stablehlo.sine %1 : tensor<1x4xf32>
    return %2 : tensor<1x4xf32>
  }
}
