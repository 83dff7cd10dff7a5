// RUN: mm-opt %s -p 'builtin.module(mm-inline-tasks)' --split-input-file --verify-diagnostics | filecheck %s

// A task call is inlined into @main: its ops get the short tag, the mesh and the
// logical mapping move to the module's mm.tasks table, and a plain call nested in
// the task body is inlined too and inherits the task's tag. Callees are removed.
// CHECK: module attributes {mm.tasks = {t = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = {{\[\["batch", "x"\]\]}}}}}
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[M:.*]] = stablehlo.multiply %arg0, %arg0 {mm.task = {name = "t", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[N:.*]] = stablehlo.negate %[[M]] {mm.task = {name = "t", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[A:.*]] = stablehlo.add %[[N]], %[[N]] : tensor<8xf32>
// CHECK-NEXT: return %[[A]]
// CHECK-NEXT: }
// CHECK-NOT: func.func
// CHECK-NOT: func.call
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @callee(%arg0) {mm.task = {name = "t", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch", "x"]]}} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = stablehlo.add %0, %0 : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @callee(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.multiply %arg0, %arg0 : tensor<8xf32>
    %1 = func.call @helper(%0) : (tensor<8xf32>) -> tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @helper(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.negate %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// jax's lowering cache shares one callee between two tasks: each call site gets
// its own copy, tagged with the call's task (identity lives on the call).
// CHECK: module attributes {mm.tasks = {a = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = []}, b = {axis_names = ["y"], axis_sizes = [2], devices = [2, 3], logical_axes = []}}}
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[A:.*]] = stablehlo.sine %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[B:.*]] = stablehlo.sine %[[A]] {mm.task = {name = "b", transpose_count = 1 : i64}}
// CHECK-NEXT: return %[[B]]
// CHECK-NOT: @shared
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @shared(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = func.call @shared(%0) {mm.task = {name = "b", transpose_count = 1 : i64, devices = [2, 3], axis_names = ["y"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @shared(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// A task call inside a stablehlo.while body (lax.scan) is inlined in place.
// CHECK: module attributes {mm.tasks = {loop = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = []}}}
// CHECK-LABEL: func.func @main
// CHECK: stablehlo.while(%[[I:.*]] = %{{.*}}, %[[X:.*]] = %arg0)
// CHECK: } do {
// CHECK-NEXT: %[[Y:.*]] = stablehlo.cosine %[[X]] {mm.task = {name = "loop", transpose_count = 0 : i64}}
// CHECK: stablehlo.return %{{.*}}, %[[Y]]
// CHECK-NOT: func.call
// CHECK-NOT: @body
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %c0 = stablehlo.constant dense<0> : tensor<i32>
    %0:2 = stablehlo.while(%i = %c0, %x = %arg0) : tensor<i32>, tensor<8xf32>
      cond {
        %c4 = stablehlo.constant dense<4> : tensor<i32>
        %p = stablehlo.compare LT, %i, %c4 : (tensor<i32>, tensor<i32>) -> tensor<i1>
        stablehlo.return %p : tensor<i1>
      } do {
        %y = func.call @body(%x) {mm.task = {name = "loop", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32>
        %c1 = stablehlo.constant dense<1> : tensor<i32>
        %j = stablehlo.add %i, %c1 : tensor<i32>
        stablehlo.return %j, %y : tensor<i32>, tensor<8xf32>
      }
    return %0#1 : tensor<8xf32>
  }
  func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// One task name with a second device list or logical mapping names a new task
// (`task(f, mesh=a)` and `task(f, mesh=b)`): the first keeps the name, the others
// get ".1", ".2", ... in program order, skipping names the module already uses. The
// backward call on the same mesh as the first forward joins that same task.
// CHECK: module attributes {mm.tasks = {t = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = []}, t.1 = {axis_names = ["x"], axis_sizes = [2], devices = [4, 5], logical_axes = []}, t.2 = {axis_names = ["x"], axis_sizes = [2], devices = [2, 3], logical_axes = []}, t.3 = {axis_names = ["x"], axis_sizes = [2], devices = [2, 3], logical_axes = {{\[\["batch", "x"\]\]}}}}}
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[A:.*]] = stablehlo.sine %arg0 {mm.task = {name = "t", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[B:.*]] = stablehlo.sine %[[A]] {mm.task = {name = "t.2", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[C:.*]] = stablehlo.sine %[[B]] {mm.task = {name = "t.3", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[D:.*]] = stablehlo.sine %[[C]] {mm.task = {name = "t.1", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[E:.*]] = stablehlo.sine %[[D]] {mm.task = {name = "t", transpose_count = 1 : i64}}
// CHECK-NEXT: return %[[E]]
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @f(%arg0) {mm.task = {name = "t", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = func.call @f(%0) {mm.task = {name = "t", transpose_count = 0 : i64, devices = [2, 3], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = func.call @f(%1) {mm.task = {name = "t", transpose_count = 0 : i64, devices = [2, 3], axis_names = ["x"], axis_sizes = [2], logical_axes = [["batch", "x"]]}} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = func.call @f(%2) {mm.task = {name = "t.1", transpose_count = 0 : i64, devices = [4, 5], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32>
    %4 = func.call @f(%3) {mm.task = {name = "t", transpose_count = 1 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32>
    return %4 : tensor<8xf32>
  }
  func.func private @f(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// A microbatch loop body (a call marked mm.microbatch) is inlined like any call; its
// ops belong to the loop: untagged ones get mm.loop, task ops get loop in their tag.
// The markers around it stay.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[I:.*]] = stablehlo.custom_call @mm.microbatch_index() {mm.loop = 0 : i64}
// CHECK-NEXT: %[[S:.*]] = stablehlo.dynamic_slice %arg0, %[[I]], sizes = [2] {mm.loop = 0 : i64}
// CHECK-NEXT: %[[T:.*]] = stablehlo.sine %[[S]] {mm.task = {loop = 0 : i64, name = "t", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[SUM:.*]] = stablehlo.custom_call @mm.microbatch_sum(%[[T]])
// CHECK-NEXT: return %[[SUM]]
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<2xf32> {
    %0 = stablehlo.custom_call @mm.microbatch_index() {mm.loop = 0 : i64} : () -> tensor<i32>
    %1 = func.call @body(%0, %arg0) {mm.microbatch = {loop = 0 : i64, num_microbatches = 4 : i64}} : (tensor<i32>, tensor<8xf32>) -> tensor<2xf32>
    %2 = stablehlo.custom_call @mm.microbatch_sum(%1) {mm.microbatch = {loop = 0 : i64, num_microbatches = 4 : i64}} : (tensor<2xf32>) -> tensor<2xf32>
    return %2 : tensor<2xf32>
  }
  func.func private @body(%i: tensor<i32>, %x: tensor<8xf32>) -> tensor<2xf32> {
    %0 = stablehlo.dynamic_slice %x, %i, sizes = [2] : (tensor<8xf32>, tensor<i32>) -> tensor<2xf32>
    %1 = func.call @t(%0) {mm.task = {name = "t", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<2xf32>) -> tensor<2xf32>
    return %1 : tensor<2xf32>
  }
  func.func private @t(%arg0: tensor<2xf32>) -> tensor<2xf32> {
    %0 = stablehlo.sine %arg0 : tensor<2xf32>
    return %0 : tensor<2xf32>
  }
}
