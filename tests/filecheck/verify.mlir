// RUN: mm-opt %s -p 'builtin.module(mm-verify)' --split-input-file --verify-diagnostics | filecheck %s

// A well-formed task call passes and is left unchanged.
// CHECK-LABEL: func @task_call
func.func @task_call(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
  // CHECK: call @body(%arg0) {mm.task = {axis_names = ["x", "y"], axis_sizes = [2, 2], devices = [0, 1, 2, 3], logical_axes = {{\[\["batch", "x"\], \["model", "y"\]\]}}, name = "layer1", transpose_count = 0 : i64}}
  %0 = func.call @body(%arg0) {mm.task = {name = "layer1", transpose_count = 0 : i64, devices = [0, 1, 2, 3], axis_names = ["x", "y"], axis_sizes = [2, 2], logical_axes = [["batch", "x"], ["model", "y"]]}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  // The backward call of the same task may share the mesh; logical_axes may be omitted.
  // CHECK: call @body(%0) {mm.task = {axis_names = ["x"], axis_sizes = [2], devices = [4, 5], name = "layer2", transpose_count = 1 : i64}}
  %1 = func.call @body(%0) {mm.task = {name = "layer2", transpose_count = 1 : i64, devices = [4, 5], axis_names = ["x"], axis_sizes = [2]}} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return %1 : tensor<8x8xf32>
}
func.func private @body(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
  return %arg0 : tensor<8x8xf32>
}

// -----

// The flat form: a task table on the module, short references on ops.
// CHECK: module attributes {mm.tasks = {layer1 = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = {{\[\["batch", "x"\]\]}}}}}
module attributes {mm.tasks = {layer1 = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch", "x"]]}}} {
  // CHECK-LABEL: func @flat_form
  func.func @flat_form(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    // CHECK: stablehlo.add %arg0, %arg0 {mm.task = {name = "layer1", transpose_count = 0 : i64}}
    %0 = stablehlo.add %arg0, %arg0 {mm.task = {name = "layer1", transpose_count = 0 : i64}} : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// Logical sharding markers: one entry per dimension, [] = unsharded.
// CHECK-LABEL: func @markers
func.func @markers(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
  // CHECK: stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = {{\[\["batch", "data"\], \[\]\]}}}
  %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch", "data"], []]} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return %0 : tensor<8x8xf32>
}

// -----

// A module without any multimesh attribute is fine.
// CHECK-LABEL: func @plain
func.func @plain(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // CHECK: stablehlo.multiply
  %0 = stablehlo.multiply %arg0, %arg0 : tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

func.func @error_task_not_dict(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' must be a dictionary attribute, got "layer1"}}
  %0 = func.call @body(%arg0) {mm.task = "layer1"} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_missing_devices(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' is missing 'devices'}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, axis_names = ["x"], axis_sizes = [1]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_unknown_key(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' has unknown key 'axis_size'}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0], axis_names = ["x"], axis_sizes = [1], axis_size = [1]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_name_not_string(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' name must be a string, got 3}}
  %0 = func.call @body(%arg0) {mm.task = {name = 3, transpose_count = 0 : i64, devices = [0], axis_names = ["x"], axis_sizes = [1]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_transpose_count(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' transpose_count must be an integer, got "0"}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = "0", devices = [0], axis_names = ["x"], axis_sizes = [1]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_empty_devices(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' devices must not be empty}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [], axis_names = [], axis_sizes = []}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_duplicate_device(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' devices [0, 1, 1] list device 1 twice}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1, 1], axis_names = ["x"], axis_sizes = [3]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_duplicate_axis(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' axis_names ["x", "x"] name axis "x" twice}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x", "x"], axis_sizes = [2, 1]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_axis_length_mismatch(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' has 2 axis_names ["x", "y"] but 1 axis_sizes [2]}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x", "y"], axis_sizes = [2]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_axis_size_not_positive(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' axis_sizes [2, 0] must be positive, got 0}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x", "y"], axis_sizes = [2, 0]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_mesh_size(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' axis_sizes [4, 1] multiply to 4 but devices has 3 entries}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1, 2], axis_names = ["x", "y"], axis_sizes = [4, 1]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_logical_unknown_axis(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' logical axis "batch" maps to device axis "z" which is not in axis_names ["x"]}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch", "z"]]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

func.func @error_logical_not_pair(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error-re@+1 {{'mm.task' logical_axes entries must be [logical, device] string pairs, got {{.*}}"batch"{{.*}}}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch"]]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

// Two calls of one task must agree on the mesh.
func.func @error_inconsistent_mesh(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-note@+1 {{earlier call of the task is here}}
  %0 = func.call @body(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2]}} : (tensor<8xf32>) -> tensor<8xf32>
  // expected-error@+1 {{'mm.task' "a" has mesh devices=[2, 3]}}
  %1 = func.call @body(%0) {mm.task = {name = "a", transpose_count = 1 : i64, devices = [2, 3], axis_names = ["x"], axis_sizes = [2]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %1 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}

// -----

// expected-error@+1 {{'mm.tasks' entry "a" axis_sizes [2] multiply to 2 but devices has 1 entries}}
module attributes {mm.tasks = {a = {devices = [0], axis_names = ["x"], axis_sizes = [2]}}} {
  func.func @error_table_entry() {
    return
  }
}

// -----

func.func @error_reference_without_table(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.task' on 'stablehlo.add' names task "a" but the module has no 'mm.tasks' table}}
  %0 = stablehlo.add %arg0, %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

module attributes {mm.tasks = {a = {devices = [0], axis_names = ["x"], axis_sizes = [1]}}} {
  func.func @error_reference_unknown_task(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    // expected-error@+1 {{'mm.task' on 'stablehlo.add' names task "b" which is not in 'mm.tasks' (known: "a")}}
    %0 = stablehlo.add %arg0, %arg0 {mm.task = {name = "b", transpose_count = 0 : i64}} : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

module attributes {mm.tasks = {a = {devices = [0], axis_names = ["x"], axis_sizes = [1]}}} {
  func.func @error_reference_extra_key(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    // expected-error@+1 {{'mm.task' on 'stablehlo.add' has unexpected key 'devices'}}
    %0 = stablehlo.add %arg0, %arg0 {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0]}} : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

func.func @error_marker_operands(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.logical_sharding' must have exactly one operand, got 2}}
  %0 = stablehlo.custom_call @mm.logical_sharding(%arg0, %arg0) {mm.axes = [[]]} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

func.func @error_marker_type(%arg0: tensor<8xf32>) -> tensor<8xi32> {
  // expected-error@+1 {{'mm.logical_sharding' result type tensor<8xi32> differs from operand type tensor<8xf32>}}
  %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [[]]} : (tensor<8xf32>) -> tensor<8xi32>
  return %0 : tensor<8xi32>
}

// -----

func.func @error_marker_no_axes(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.logical_sharding' is missing 'mm.axes'}}
  %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

func.func @error_marker_rank(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
  // expected-error@+1 {{'mm.logical_sharding' 'mm.axes' has 1 entries but the operand tensor<8x8xf32> has rank 2}}
  %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"]]} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return %0 : tensor<8x8xf32>
}

// -----

func.func @error_marker_entry_not_strings(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mm.logical_sharding' 'mm.axes' entry 0 must be a list of strings, got [1]}}
  %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [[1]]} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

func.func @error_marker_axis_twice(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
  // expected-error@+1 {{'mm.logical_sharding' logical axis "batch" is used by dimensions 0 and 1}}
  %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["batch"], ["batch"]]} : (tensor<8x8xf32>) -> tensor<8x8xf32>
  return %0 : tensor<8x8xf32>
}
