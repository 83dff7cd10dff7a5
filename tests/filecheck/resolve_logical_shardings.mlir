// RUN: mm-opt %s -p 'builtin.module(mm-resolve-logical-shardings)' --split-input-file --verify-diagnostics | filecheck %s

// 1-D mesh: batch -> x.
// CHECK-LABEL: module attributes {mm.tasks
// CHECK: sdy.mesh @mesh_t1 = <["x"=8]>
// CHECK-LABEL: func.func @one_d
// CHECK-NEXT: %[[C:.*]] = sdy.sharding_constraint %arg0 <@mesh_t1, [{"x"}, {}]> {mm.task = {name = "t1", transpose_count = 0 : i64}} : tensor<8x8xf32>
// CHECK-NEXT: %[[D:.*]] = sdy.sharding_constraint %[[C]] <@mesh_t1, [{}, {"x"}]> {mm.task = {name = "t1", transpose_count = 1 : i64}} : tensor<8x8xf32>
// CHECK-NEXT: return %[[D]]
// CHECK-NOT: mm.logical_sharding
module attributes {mm.tasks = {t1 = {devices = [0, 1, 2, 3, 4, 5, 6, 7], axis_names = ["x"], axis_sizes = [8], logical_axes = [["batch", "x"], ["model", "x"]]}}} {
  func.func @one_d(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["model"], []], mm.task = {name = "t1", transpose_count = 0 : i64}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %1 = stablehlo.custom_call @mm.logical_sharding(%0) {mm.axes = [[], ["model"]], mm.task = {name = "t1", transpose_count = 1 : i64}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %1 : tensor<8x8xf32>
  }
}

// -----

// 2-D mesh, two device axes on one dim (listed in mesh order), unknown logical
// name "seq" leaves its dim unsharded.
// CHECK-LABEL: module attributes {mm.tasks
// CHECK: sdy.mesh @mesh_t2 = <["x"=4, "y"=2]>
// CHECK-LABEL: func.func @two_axes
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_t2, [{"x", "y"}, {}]>
// CHECK-NEXT: sdy.sharding_constraint %arg1 <@mesh_t2, [{}, {"x"}]>
module attributes {mm.tasks = {t2 = {devices = [0, 1, 2, 3, 4, 5, 6, 7], axis_names = ["x", "y"], axis_sizes = [4, 2], logical_axes = [["batch", "x"], ["embed", "x"], ["model", "y"]]}}} {
  func.func @two_axes(%arg0: tensor<8x4xf32>, %arg1: tensor<16x16xf32>) -> (tensor<8x4xf32>, tensor<16x16xf32>) {
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch", "model"], ["seq"]], mm.task = {name = "t2", transpose_count = 0 : i64}} : (tensor<8x4xf32>) -> tensor<8x4xf32>
    %1 = stablehlo.custom_call @mm.logical_sharding(%arg1) {mm.axes = [["hidden"], ["embed"]], mm.task = {name = "t2", transpose_count = 0 : i64}} : (tensor<16x16xf32>) -> tensor<16x16xf32>
    return %0, %1 : tensor<8x4xf32>, tensor<16x16xf32>
  }
}

// -----

// Over-shard skip: dim 0 (size 2) is too small for x=4, so batch -> x is skipped
// there and x goes to dim 1 through the lower-priority model -> x.
// CHECK-LABEL: func.func @over_shard
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_t3, [{}, {"x"}]>
module attributes {mm.tasks = {t3 = {devices = [0, 1, 2, 3], axis_names = ["x"], axis_sizes = [4], logical_axes = [["batch", "x"], ["model", "x"]]}}} {
  func.func @over_shard(%arg0: tensor<2x8xf32>) -> tensor<2x8xf32> {
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"], ["model"]], mm.task = {name = "t3", transpose_count = 0 : i64}} : (tensor<2x8xf32>) -> tensor<2x8xf32>
    return %0 : tensor<2x8xf32>
  }
}

// -----

// Empty logical mapping: every logical name means "replicated" on the task's devices,
// written explicitly on the task's mesh.
// CHECK-LABEL: module attributes {mm.tasks
// CHECK: sdy.mesh @mesh_mm_default = <["x"=2]>
// CHECK-LABEL: func.func @empty_mapping
// CHECK-NEXT: %[[C:.*]] = sdy.sharding_constraint %arg0 <@mesh_mm_default, [{}]>
// CHECK-NEXT: %[[A:.*]] = stablehlo.add %[[C]], %[[C]]
// CHECK-NEXT: return %[[A]]
module attributes {mm.tasks = {mm.default = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @empty_mapping(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"]], mm.task = {name = "mm.default", transpose_count = 0 : i64}} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = stablehlo.add %0, %0 {mm.task = {name = "mm.default", transpose_count = 0 : i64}} : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
}

// -----

// A marker inside a while body takes the enclosing while's task; the new op gets no
// mm.task of its own (ops nested in a tagged op belong to it).
// CHECK-LABEL: func.func @in_while
// CHECK: stablehlo.while({{.*}}) : tensor<i32>, tensor<8xf32> attributes {mm.task = {name = "loop", transpose_count = 0 : i64}}
// CHECK: } do {
// CHECK-NEXT: %[[S:.*]] = sdy.sharding_constraint %{{.*}} <@mesh_loop, [{"x"}]> : tensor<8xf32>
// CHECK-NEXT: stablehlo.return %{{.*}}, %[[S]]
module attributes {mm.tasks = {loop = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch", "x"]]}}} {
  func.func @in_while(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %c0 = stablehlo.constant {mm.task = {name = "loop", transpose_count = 0 : i64}} dense<0> : tensor<i32>
    %0:2 = stablehlo.while(%i = %c0, %x = %arg0) : tensor<i32>, tensor<8xf32> attributes {mm.task = {name = "loop", transpose_count = 0 : i64}}
      cond {
        %c4 = stablehlo.constant dense<4> : tensor<i32>
        %p = stablehlo.compare LT, %i, %c4 : (tensor<i32>, tensor<i32>) -> tensor<i1>
        stablehlo.return %p : tensor<i1>
      } do {
        %y = stablehlo.custom_call @mm.logical_sharding(%x) {mm.axes = [["batch"]]} : (tensor<8xf32>) -> tensor<8xf32>
        stablehlo.return %i, %y : tensor<i32>, tensor<8xf32>
      }
    return %0#1 : tensor<8xf32>
  }
}

// -----

// Two tasks -> two meshes, created once each, in sorted task order; task names with
// characters invalid in symbols are sanitised.
// CHECK-LABEL: module attributes {mm.tasks
// CHECK-NEXT: sdy.mesh @mesh_layer_1 = <["x"=2]>
// CHECK-NEXT: sdy.mesh @mesh_stage0 = <["x"=2, "y"=2]>
// CHECK-NEXT: func.func @two_tasks
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_stage0, [{"x"}, {"y"}]>
// CHECK-NEXT: sdy.sharding_constraint %{{.*}} <@mesh_layer_1, [{"x"}, {}]>
// CHECK-NEXT: sdy.sharding_constraint %{{.*}} <@mesh_stage0, [{}, {"y"}]>
module attributes {mm.tasks = {stage0 = {devices = [0, 1, 2, 3], axis_names = ["x", "y"], axis_sizes = [2, 2], logical_axes = [["batch", "x"], ["model", "y"]]}, "layer.1" = {devices = [4, 5], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch", "x"]]}}} {
  func.func @two_tasks(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"], ["model"]], mm.task = {name = "stage0", transpose_count = 0 : i64}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %1 = stablehlo.custom_call @mm.logical_sharding(%0) {mm.axes = [["batch"], ["model"]], mm.task = {name = "layer.1", transpose_count = 0 : i64}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %2 = stablehlo.custom_call @mm.logical_sharding(%1) {mm.axes = [[], ["model"]], mm.task = {name = "stage0", transpose_count = 0 : i64}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %2 : tensor<8x8xf32>
  }
}

// -----

module attributes {mm.tasks = {t = {devices = [0, 1, 2, 3], axis_names = ["x"], axis_sizes = [4], logical_axes = [["batch", "z"]]}}} {
  func.func @unknown_device_axis(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    // expected-error@+1 {{Logical axis 'batch' is mapped to device axis 'z', which is not an axis of the mesh of task 't'. Valid device axis names are: 'x'.}}
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"]], mm.task = {name = "t", transpose_count = 0 : i64}} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

module attributes {mm.tasks = {t = {devices = [0, 1, 2, 3], axis_names = ["x"], axis_sizes = [4], logical_axes = [["batch", "x"]]}}} {
  func.func @non_dividing(%arg0: tensor<6x8xf32>) -> tensor<6x8xf32> {
    // expected-error@+1 {{Cannot shard dimension 0 of tensor of shape (6, 8) over device axis 'x' (size 4): 4 does not evenly divide 6.}}
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"], []], mm.task = {name = "t", transpose_count = 0 : i64}} : (tensor<6x8xf32>) -> tensor<6x8xf32>
    return %0 : tensor<6x8xf32>
  }
}

// -----

module attributes {mm.tasks = {t = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch", "x"]]}}} {
  func.func @untagged(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    // expected-error@+1 {{logical sharding marker is not assigned to a task; run mm-assign-tasks first}}
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"]]} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

module attributes {mm.tasks = {t = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch", "x"]]}}} {
  func.func @unknown_task(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    // expected-error@+1 {{logical sharding marker is assigned to task 'nope', which is not in the module's mm.tasks table (known tasks: 't')}}
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"]], mm.task = {name = "nope", transpose_count = 0 : i64}} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

module attributes {mm.tasks = {t = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch", "x"]]}}} {
  // expected-error@+1 {{symbol @mesh_t for task 't' already exists as mesh #sdy.mesh<["x"=4]>, which differs from the task's mesh #sdy.mesh<["x"=2]>}}
  sdy.mesh @mesh_t = <["x"=4]>
  func.func @conflicting_mesh(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"]], mm.task = {name = "t", transpose_count = 0 : i64}} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// A marker in the body of a leaf task call (flat form) resolves with the task of the
// body's function.
// CHECK-LABEL: func.func private @body
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_t, [{"x"}, {}]> : tensor<8x8xf32>
module attributes {mm.tasks = {t = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = [["batch", "x"]]}}} {
  func.func @main(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    %0 = call @body(%arg0) {mm.task = {name = "t", transpose_count = 0 : i64}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
  func.func private @body(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> attributes {mm.task = {name = "t", transpose_count = 0 : i64}} {
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"], []]} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %1 = stablehlo.sine %0 : tensor<8x8xf32>
    return %1 : tensor<8x8xf32>
  }
}

// -----

// Logical names that no task maps and that look like mistakes warn, once per name,
// and still resolve to unsharded: a typo (with the closest mapped names), a mesh axis
// name used as a logical name, and the device side of a swapped pair. A name that a
// task maps is fine in a task that does not ("model" in "layer.1" above), and so is
// one that resembles no mapped name ("seq" and "hidden" in @two_axes).
// CHECK-LABEL: func.func @unmapped_names
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_t, [{}, {}]>
// CHECK-NEXT: sdy.sharding_constraint %{{.*}} <@mesh_t, [{}, {}]>
// CHECK-NEXT: sdy.sharding_constraint %{{.*}} <@mesh_t, [{}, {"x"}]>
// CHECK-NEXT: sdy.sharding_constraint %{{.*}} <@mesh_u, [{}, {}]>
module attributes {mm.tasks = {t = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch", "x"], ["model", "x"]]}, u = {devices = [2, 3], axis_names = ["y"], axis_sizes = [2], logical_axes = [["y", "data"]]}}} {
  func.func @unmapped_names(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    // expected-warning@+1 {{logical axis name 'btach' is mapped by no task of the program, so it leaves its dimension unsharded in task 't'; did you mean 'batch'? (the logical names the tasks map: 'batch', 'model', 'y')}}
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["btach"], []], mm.task = {name = "t", transpose_count = 0 : i64}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    // expected-warning@+1 {{logical axis name 'x' is mapped by no task of the program, so it leaves its dimension unsharded in task 't'; 'x' is a mesh axis of task 't', not a logical name: use a logical name that task 't' maps onto it ('batch' or 'model')}}
    %1 = stablehlo.custom_call @mm.logical_sharding(%0) {mm.axes = [["x"], ["btach"]], mm.task = {name = "t", transpose_count = 1 : i64}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %2 = stablehlo.custom_call @mm.logical_sharding(%1) {mm.axes = [["x"], ["model"]], mm.task = {name = "t", transpose_count = 0 : i64}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    // expected-warning@+1 {{logical axis name 'data' is mapped by no task of the program, so it leaves its dimension unsharded in task 'u'; task 'u' has the pair ('y', 'data'), which maps its mesh axis 'y' as a logical name onto 'data', not an axis of its mesh: the pair looks swapped, write ('data', 'y') in its logical_axes}}
    %3 = stablehlo.custom_call @mm.logical_sharding(%2) {mm.axes = [["data"], []], mm.task = {name = "u", transpose_count = 0 : i64}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %3 : tensor<8x8xf32>
  }
}

// -----

// No task maps any logical name (a program without tasks: only the default task, with
// no mapping): every name means replicated, as in MultiMesh, and nothing warns.
// CHECK-LABEL: func.func @no_mapping_anywhere
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_mm_default, [{}]>
module attributes {mm.tasks = {mm.default = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @no_mapping_anywhere(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["x"]], mm.task = {name = "mm.default", transpose_count = 0 : i64}} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// Shardings written for the global mesh ("stage", "data", "model"): inside a task the
// mesh is the task's mesh, so each moves onto @mesh_<task> by axis name (the sliced
// "stage" has size 1 there), on constraints, on ops' results and on a leaf task's body.
// CHECK: sdy.mesh @mesh = <["stage"=2, "data"=2, "model"=2]>
// CHECK: sdy.mesh @mesh_s0 = <["stage"=1, "data"=2, "model"=2]>
// CHECK: sdy.mesh @mesh_s1 = <["stage"=1, "data"=2, "model"=2]>
// CHECK-LABEL: func.func @global_mesh
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_s0, [{"data"}, {}]>
// CHECK-NEXT: stablehlo.tanh %{{.*}} {mm.task = {name = "s1", transpose_count = 0 : i64}, sdy.sharding = #sdy.sharding_per_value<[<@mesh_s1, [{"data"}, {"model"}]>]>}
// CHECK-LABEL: func.func private @body
// CHECK-SAME: sdy.sharding = #sdy.sharding<@mesh_s1, [{}, {"model"}]>
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_s1, [{}, {"model"}]>
module attributes {mm.tasks = {s0 = {devices = [0, 1, 2, 3], axis_names = ["stage", "data", "model"], axis_sizes = [1, 2, 2], logical_axes = []}, s1 = {devices = [4, 5, 6, 7], axis_names = ["stage", "data", "model"], axis_sizes = [1, 2, 2], logical_axes = []}}} {
  sdy.mesh @mesh = <["stage"=2, "data"=2, "model"=2]>
  func.func @global_mesh(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    %0 = sdy.sharding_constraint %arg0 <@mesh, [{"data"}, {}]> {mm.task = {name = "s0", transpose_count = 0 : i64}} : tensor<8x8xf32>
    %1 = stablehlo.tanh %0 {mm.task = {name = "s1", transpose_count = 0 : i64}, sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{"data"}, {"model"}]>]>} : tensor<8x8xf32>
    return %1 : tensor<8x8xf32>
  }
  func.func private @body(%arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"model"}]>}) -> tensor<8x8xf32> attributes {mm.task = {name = "s1", transpose_count = 0 : i64}} {
    %0 = sdy.sharding_constraint %arg0 <@mesh, [{}, {"model"}]> : tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}

// -----

// Explicit mode lists the explicit axes a value is not sharded over as `replicated`:
// replicated over the sliced "stage" (one device in the task) or over an axis the
// task's mesh lacks asks for nothing, so it is dropped, not refused; replicated over
// an axis the task keeps stays.
// CHECK-LABEL: func.func @replicated_over_the_sliced_axis
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_s0, [{"data", ?}, {?}]> {mm.task
// CHECK-NEXT: sdy.sharding_constraint %{{.*}} <@mesh_s0, [{"data"}, {}], replicated={"model"}> {mm.task
// CHECK-NEXT: sdy.sharding_constraint %{{.*}} <@mesh_s0, [{"data"}, {}]> {mm.task
module attributes {mm.tasks = {s0 = {devices = [0, 1, 2, 3], axis_names = ["stage", "data", "model"], axis_sizes = [1, 2, 2], logical_axes = []}}} {
  sdy.mesh @mesh = <["stage"=2, "data"=2, "model"=2, "pod"=2]>
  func.func @replicated_over_the_sliced_axis(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    %0 = sdy.sharding_constraint %arg0 <@mesh, [{"data", ?}, {?}], replicated={"stage"}> {mm.task = {name = "s0", transpose_count = 0 : i64}} : tensor<8x8xf32>
    %1 = sdy.sharding_constraint %0 <@mesh, [{"data"}, {}], replicated={"stage", "model"}> {mm.task = {name = "s0", transpose_count = 0 : i64}} : tensor<8x8xf32>
    %2 = sdy.sharding_constraint %1 <@mesh, [{"data"}, {}], replicated={"pod"}> {mm.task = {name = "s0", transpose_count = 0 : i64}} : tensor<8x8xf32>
    return %2 : tensor<8x8xf32>
  }
}

// -----

// A program argument placed sharded over the axis a task slices away (NNX metadata
// ("stage", None) on the global mesh) moves onto the task's mesh without it: a warning
// at the task's first op that uses it, once per task; one over a kept axis is quiet.
module attributes {mm.tasks = {s0 = {devices = [0, 1, 2, 3], axis_names = ["stage", "data", "model"], axis_sizes = [1, 2, 2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8x8xf32> {mm.devices = [0, 1, 2, 3, 4, 5, 6, 7], mm.sharding = #sdy.sharding<mesh<["stage"=2, "data"=2, "model"=2]>, [{"stage"}, {}]>} loc("var_vals[1]"), %arg1: tensor<8x8xf32> {mm.devices = [0, 1, 2, 3, 4, 5, 6, 7], mm.sharding = #sdy.sharding<mesh<["stage"=2, "data"=2, "model"=2]>, [{}, {"model"}]>}) -> tensor<8x8xf32> {
    // expected-warning@+1 {{argument 'var_vals[1]' is placed sharded over the mesh axis 'stage' (#sdy.sharding<mesh<["stage"=2, "data"=2, "model"=2]>, [{"stage"}, {}]>), which task 's0' that uses it slices away: inside a task the mesh is the task's mesh, with the axes ['data', 'model'] (device positions [0, 1, 2, 3]), so the value moves onto it with 'stage' dropped from its layout. Partition it over the task's axes only (for NNX metadata or flax rules: leave 'stage' out)}}
    %0 = stablehlo.add %arg0, %arg1 {mm.task = {name = "s0", transpose_count = 0 : i64}} : tensor<8x8xf32>
    %1 = stablehlo.multiply %0, %arg0 {mm.task = {name = "s0", transpose_count = 0 : i64}} : tensor<8x8xf32>
    return %1 : tensor<8x8xf32>
  }
}

// -----

// A size-one axis of the task's mesh splits nothing there: a sharding over the sliced
// "stage" (size 1 in the task's mesh) drops it, on a dimension, beside another axis,
// in `unreduced` and in a logical sharding mapped onto it, so the dimension is
// replicated over it (as MaxText drops size-one mesh axes).
// CHECK: sdy.mesh @mesh_s0 = <["stage"=1, "data"=2, "model"=2]>
// CHECK-LABEL: func.func @size_one_axis
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_s0, [{}, {}]> {mm.task
// CHECK-NEXT: sdy.sharding_constraint %{{.*}} <@mesh_s0, [{"data"}, {}]> {mm.task
// CHECK-NEXT: sdy.sharding_constraint %{{.*}} <@mesh_s0, [{}, {"model"}]> {mm.task
// CHECK-NEXT: sdy.sharding_constraint %{{.*}} <@mesh_s0, [{"data"}, {}]> {mm.task
module attributes {mm.tasks = {s0 = {devices = [0, 1, 2, 3], axis_names = ["stage", "data", "model"], axis_sizes = [1, 2, 2], logical_axes = [["layers", "stage"], ["batch", "data"]]}}} {
  sdy.mesh @mesh = <["stage"=2, "data"=2, "model"=2]>
  func.func @size_one_axis(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    %0 = sdy.sharding_constraint %arg0 <@mesh, [{"stage"}, {}]> {mm.task = {name = "s0", transpose_count = 0 : i64}} : tensor<8x8xf32>
    %1 = sdy.sharding_constraint %0 <@mesh, [{"stage", "data"}, {}]> {mm.task = {name = "s0", transpose_count = 0 : i64}} : tensor<8x8xf32>
    %2 = sdy.sharding_constraint %1 <@mesh, [{}, {"model"}], unreduced={"stage"}> {mm.task = {name = "s0", transpose_count = 0 : i64}} : tensor<8x8xf32>
    %3 = stablehlo.custom_call @mm.logical_sharding(%2) {mm.axes = [["layers", "batch"], []], mm.task = {name = "s0", transpose_count = 0 : i64}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %3 : tensor<8x8xf32>
  }
}

// -----

// A `TaskMesh` axis of size 1 is dropped the same way.
// CHECK-LABEL: func.func @size_one_task_mesh_axis
// CHECK-NEXT: sdy.sharding_constraint %arg0 <@mesh_t, [{"x"}, {}]> {mm.task
module attributes {mm.tasks = {t = {devices = [0, 1, 2, 3], axis_names = ["x", "pod"], axis_sizes = [4, 1], logical_axes = []}}} {
  sdy.mesh @mesh = <["x"=4, "pod"=2]>
  func.func @size_one_task_mesh_axis(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    %0 = sdy.sharding_constraint %arg0 <@mesh, [{"x", "pod"}, {}]> {mm.task = {name = "t", transpose_count = 0 : i64}} : tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}

// -----

// A `shard_map` splitting an operand over the sliced axis was traced with that split
// (its body sees half the rows): it cannot run on one slice, an error at the op.
module attributes {mm.tasks = {s0 = {devices = [0, 1, 2, 3], axis_names = ["stage", "data", "model"], axis_sizes = [1, 2, 2], logical_axes = []}}} {
  sdy.mesh @mesh = <["stage"=2, "data"=2, "model"=2]>
  func.func @shard_map_over_the_sliced_axis(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
    // expected-error@+1 {{a sharding in task 's0' names the mesh axis 'stage', which is sliced away (the task is one slice of it); inside a task the mesh is the task's mesh, with the axes ['data', 'model'] (device positions [0, 1, 2, 3]). Shard over those axes only, or give the task a mesh with an axis 'stage'}}
    %0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, [{"stage"}, {}]>] out_shardings=[<@mesh, [{"stage"}, {}]>] manual_axes={"stage", "data", "model"} (%x: tensor<2x8xf32>) {
      sdy.return %x : tensor<2x8xf32>
    } {mm.task = {name = "s0", transpose_count = 0 : i64}} : (tensor<4x8xf32>) -> tensor<4x8xf32>
    return %0 : tensor<4x8xf32>
  }
}

// -----

// An axis the task's mesh lacks cannot apply inside the task: an error at the op.
module attributes {mm.tasks = {t = {devices = [0, 1, 2, 3], axis_names = ["x"], axis_sizes = [4], logical_axes = []}}} {
  sdy.mesh @mesh = <["fsdp"=2, "tp"=4]>
  func.func @missing_axis(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    // expected-error@+1 {{a sharding in task 't' names the mesh axis 'fsdp', which is not an axis of the task's mesh; inside a task the mesh is the task's mesh, with the axes ['x'] (device positions [0, 1, 2, 3]). Shard over those axes only, or give the task a mesh with an axis 'fsdp'}}
    %0 = sdy.sharding_constraint %arg0 <@mesh, [{"fsdp"}, {}]> {mm.task = {name = "t", transpose_count = 0 : i64}} : tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}

// -----

// A maximal mesh (a host callback's device) is no global mesh: it stays.
// CHECK-LABEL: func.func @maximal
// CHECK: sdy.sharding = #sdy.sharding_per_value<[<@maximal_mesh_0, []>]>
module attributes {mm.tasks = {t = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  sdy.mesh @maximal_mesh_0 = <[], device_ids=[0]>
  func.func @maximal(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.tanh %arg0 {mm.task = {name = "t", transpose_count = 0 : i64}, sdy.sharding = #sdy.sharding_per_value<[<@maximal_mesh_0, []>]>} : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// A shard_map traced on the global mesh ("stage", "data", "model") inside stage s1:
// its collectives' device numbers (flat positions in the global mesh) become positions
// on the task's mesh, by axis name (the sliced "stage", of size 1 there, stays manual).
// CHECK-LABEL: func.func @shard_map_collectives
// CHECK: sdy.manual_computation(%arg0) in_shardings=[<@mesh_s1, [{"data"}, {"model"}]>] out_shardings=[<@mesh_s1, [{"data"}, {}]>] manual_axes={"stage", "data", "model"}
// CHECK: "stablehlo.all_reduce"
// CHECK-SAME{LITERAL}: replica_groups = dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>
// CHECK: "stablehlo.all_gather"
// CHECK-SAME{LITERAL}: replica_groups = dense<[[0, 2], [1, 3]]> : tensor<2x2xi64>
// CHECK: "stablehlo.collective_permute"
// CHECK-SAME{LITERAL}: source_target_pairs = dense<[[0, 2], [2, 0], [1, 3], [3, 1]]> : tensor<4x2xi64>
module attributes {mm.tasks = {s1 = {devices = [4, 5, 6, 7], axis_names = ["stage", "data", "model"], axis_sizes = [1, 2, 2], logical_axes = []}}} {
  sdy.mesh @mesh = <["stage"=2, "data"=2, "model"=2]>
  func.func @shard_map_collectives(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, [{"data"}, {"model"}]>] out_shardings=[<@mesh, [{"data"}, {}]>] manual_axes={"stage", "data", "model"} (%x: tensor<2x4xf32>) {
      %1 = "stablehlo.all_reduce"(%x) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1], [2, 3], [4, 5], [6, 7]]> : tensor<4x2xi64>, use_global_device_ids}> ({
      ^bb0(%a: tensor<f32>, %b: tensor<f32>):
        %s = stablehlo.add %a, %b : tensor<f32>
        stablehlo.return %s : tensor<f32>
      }) : (tensor<2x4xf32>) -> tensor<2x4xf32>
      %2 = "stablehlo.all_gather"(%1) <{all_gather_dim = 1 : i64, channel_handle = #stablehlo.channel_handle<handle = 2, type = 1>, replica_groups = dense<[[0, 2], [1, 3], [4, 6], [5, 7]]> : tensor<4x2xi64>, use_global_device_ids}> : (tensor<2x4xf32>) -> tensor<2x8xf32>
      %3 = "stablehlo.collective_permute"(%2) <{channel_handle = #stablehlo.channel_handle<handle = 3, type = 1>, source_target_pairs = dense<[[0, 2], [2, 0], [1, 3], [3, 1], [4, 6], [6, 4], [5, 7], [7, 5]]> : tensor<8x2xi64>}> : (tensor<2x8xf32>) -> tensor<2x8xf32>
      sdy.return %3 : tensor<2x8xf32>
    } {mm.task = {name = "s1", transpose_count = 0 : i64}} : (tensor<4x8xf32>) -> tensor<4x8xf32>
    return %0 : tensor<4x8xf32>
  }
}

// -----

// A collective over the sliced axis would need devices outside the task: an error at
// the op, naming the axis and the task.
module attributes {mm.tasks = {s0 = {devices = [0, 1, 2, 3], axis_names = ["stage", "data", "model"], axis_sizes = [1, 2, 2], logical_axes = []}}} {
  sdy.mesh @mesh = <["stage"=2, "data"=2, "model"=2]>
  func.func @collective_over_the_sliced_axis(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, [{"data"}, {}]>] out_shardings=[<@mesh, [{"data"}, {}]>] manual_axes={"stage", "data", "model"} (%x: tensor<2x8xf32>) {
      // expected-error-re@+1 {{a `psum` in a `shard_map` of task 's0' runs over the mesh axis 'stage', which is sliced away (the task is one slice of it); inside a task a collective runs among the task's devices only (positions [0, 1, 2, 3]), over the axes ['data', 'model']{{.*}}}}
      %1 = "stablehlo.all_reduce"(%x) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 4], [1, 5], [2, 6], [3, 7]]> : tensor<4x2xi64>, use_global_device_ids}> ({
      ^bb0(%a: tensor<f32>, %b: tensor<f32>):
        %s = stablehlo.add %a, %b : tensor<f32>
        stablehlo.return %s : tensor<f32>
      }) : (tensor<2x8xf32>) -> tensor<2x8xf32>
      sdy.return %1 : tensor<2x8xf32>
    } {mm.task = {name = "s0", transpose_count = 0 : i64}} : (tensor<4x8xf32>) -> tensor<4x8xf32>
    return %0 : tensor<4x8xf32>
  }
}

// -----

// A task mesh without "stage" and with its axes in another order ("model", "data"):
// "stage" leaves manual_axes, the groups over "model" become the task's positions
// (model-major: [[0, 2], [1, 3]]), and partition_id (what jax's axis_index divides
// by the traced mesh's axis sizes) is read through a table of each device's position
// in the traced mesh.
// CHECK-LABEL: func.func @other_axis_order
// CHECK: manual_axes={"data", "model"}
// CHECK: %[[PID:.*]] = stablehlo.partition_id : tensor<ui32>
// CHECK-NEXT: %[[TBL:.*]] = stablehlo.constant dense<[0, 2, 1, 3]> : tensor<4xui32>
// CHECK-NEXT: %[[AT:.*]] = stablehlo.dynamic_slice %[[TBL]], %[[PID]], sizes = [1]
// CHECK-NEXT: %[[POS:.*]] = stablehlo.reshape %[[AT]] : (tensor<1xui32>) -> tensor<ui32>
// CHECK-NEXT: stablehlo.remainder %[[POS]]
// CHECK: "stablehlo.all_reduce"
// CHECK-SAME{LITERAL}: replica_groups = dense<[[0, 2], [1, 3]]> : tensor<2x2xi64>
module attributes {mm.tasks = {t = {devices = [0, 1, 2, 3], axis_names = ["model", "data"], axis_sizes = [2, 2], logical_axes = []}}} {
  sdy.mesh @mesh = <["stage"=2, "data"=2, "model"=2]>
  func.func @other_axis_order(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, [{"data"}, {}]>] out_shardings=[<@mesh, [{"data"}, {}]>] manual_axes={"stage", "data", "model"} (%x: tensor<2x8xf32>) {
      %c = stablehlo.constant dense<2> : tensor<ui32>
      %p = stablehlo.partition_id : tensor<ui32>
      %m = stablehlo.remainder %p, %c : tensor<ui32>
      %1 = "stablehlo.all_reduce"(%x) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1], [2, 3], [4, 5], [6, 7]]> : tensor<4x2xi64>, use_global_device_ids}> ({
      ^bb0(%a: tensor<f32>, %b: tensor<f32>):
        %s = stablehlo.add %a, %b : tensor<f32>
        stablehlo.return %s : tensor<f32>
      }) : (tensor<2x8xf32>) -> tensor<2x8xf32>
      sdy.return %1 : tensor<2x8xf32>
    } {mm.task = {name = "t", transpose_count = 0 : i64}} : (tensor<4x8xf32>) -> tensor<4x8xf32>
    return %0 : tensor<4x8xf32>
  }
}
