// RUN: mm-opt %s -p 'builtin.module(mm-inline-tasks)' --split-input-file --verify-diagnostics | filecheck %s

// A leaf task call (no task inside its body) stays one call: its tag becomes the
// short one, on the call and on its callee; the mesh and the logical mapping move to
// the module's mm.tasks table; a plain call in the body is inlined into it.
// CHECK: module attributes {mm.tasks = {t = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = {{\[\["batch", "x"\]\]}}}}}
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[C:.*]] = call @callee(%arg0) {mm.task = {name = "t", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[A:.*]] = stablehlo.add %[[C]], %[[C]] : tensor<8xf32>
// CHECK-NEXT: return %[[A]]
// CHECK-NEXT: }
// CHECK-NEXT: func.func private @callee(%[[X:.*]]: tensor<8xf32>) -> tensor<8xf32> attributes {mm.task = {name = "t", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[M:.*]] = stablehlo.multiply %[[X]], %[[X]] : tensor<8xf32>
// CHECK-NEXT: %[[N:.*]] = stablehlo.negate %[[M]] : tensor<8xf32>
// CHECK-NEXT: return %[[N]]
// CHECK-NOT: func.call
// CHECK-NOT: @helper
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
// CHECK-NEXT: %[[A:.*]] = call @[[FA:shared.*]](%arg0) {mm.task = {name = "a", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[B:.*]] = call @[[FB:shared.*]](%[[A]]) {mm.task = {name = "b", transpose_count = 1 : i64}}
// CHECK-NEXT: return %[[B]]
// CHECK-DAG: func.func private @[[FA]]({{.*}}) -> tensor<8xf32> attributes {mm.task = {name = "a", transpose_count = 0 : i64}}
// CHECK-DAG: func.func private @[[FB]]({{.*}}) -> tensor<8xf32> attributes {mm.task = {name = "b", transpose_count = 1 : i64}}
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

// A kept call takes what its inlined body would read, in the order it first reads
// it (the unused argument is dropped), and yields what it makes in the order it makes
// it, each value once: the signature outlining would have seen with the body inlined.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[R:.*]]:2 = call @body(%arg1, %arg0) {mm.task = {name = "t", transpose_count = 0 : i64}} : (tensor<8xf32>, tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>)
// CHECK-NEXT: return %[[R]]#1, %[[R]]#0, %[[R]]#1
// CHECK: func.func private @body(%[[B:.*]]: tensor<8xf32>, %[[A:.*]]: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>)
// CHECK-NEXT: %[[S:.*]] = stablehlo.sine %[[B]]
// CHECK-NEXT: %[[T:.*]] = stablehlo.add %[[S]], %[[A]]
// CHECK-NEXT: return %[[S]], %[[T]]
module {
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>, %arg2: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) {
    %0:3 = func.call @body(%arg0, %arg1, %arg2) {mm.task = {name = "t", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>)
    return %0#0, %0#1, %0#2 : tensor<8xf32>, tensor<8xf32>, tensor<8xf32>
  }
  func.func private @body(%a: tensor<8xf32>, %b: tensor<8xf32>, %unused: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) {
    %0 = stablehlo.sine %b : tensor<8xf32>
    %1 = stablehlo.add %0, %a : tensor<8xf32>
    return %1, %0, %1 : tensor<8xf32>, tensor<8xf32>, tensor<8xf32>
  }
}

// -----

// A task whose body calls another task is inlined (its ops tagged); the inner task
// call, a leaf, stays a call.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[S:.*]] = stablehlo.sine %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[C:.*]] = call @inner(%[[S]]) {mm.task = {name = "b", transpose_count = 0 : i64}}
// CHECK-NEXT: return %[[C]]
// CHECK-NOT: @outer
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @outer(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @outer(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    %1 = func.call @inner(%0) {mm.task = {name = "b", transpose_count = 0 : i64, devices = [2, 3], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @inner(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
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
// backward call on the same mesh as the first forward joins that same task. (Leaf
// calls: each keeps a copy of the shared body.)
// CHECK: module attributes {mm.tasks = {t = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = []}, t.1 = {axis_names = ["x"], axis_sizes = [2], devices = [4, 5], logical_axes = []}, t.2 = {axis_names = ["x"], axis_sizes = [2], devices = [2, 3], logical_axes = []}, t.3 = {axis_names = ["x"], axis_sizes = [2], devices = [2, 3], logical_axes = {{\[\["batch", "x"\]\]}}}}}
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[A:.*]] = call @f{{.*}}(%arg0) {mm.task = {name = "t", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[B:.*]] = call @f{{.*}}(%[[A]]) {mm.task = {name = "t.2", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[C:.*]] = call @f{{.*}}(%[[B]]) {mm.task = {name = "t.3", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[D:.*]] = call @f{{.*}}(%[[C]]) {mm.task = {name = "t.1", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[E:.*]] = call @f{{.*}}(%[[D]]) {mm.task = {name = "t", transpose_count = 1 : i64}}
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
// ops belong to the loop: untagged ones get mm.loop, task calls get loop in their tag.
// The markers around it stay.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[I:.*]] = stablehlo.custom_call @mm.microbatch_index() {mm.loop = 0 : i64}
// CHECK-NEXT: %[[S:.*]] = stablehlo.dynamic_slice %arg0, %[[I]], sizes = [2] {mm.loop = 0 : i64}
// CHECK-NEXT: %[[T:.*]] = call @t(%[[S]]) {mm.task = {loop = 0 : i64, name = "t", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[SUM:.*]] = stablehlo.custom_call @mm.microbatch_sum(%[[T]])
// CHECK-NEXT: return %[[SUM]]
// CHECK: func.func private @t({{.*}} attributes {mm.task = {loop = 0 : i64, name = "t", transpose_count = 0 : i64}}
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

// -----

// The same with an argument read many times (found by walking the body, not by its
// uses): %b is read first, so it comes first.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: call @body(%arg1, %arg0) {mm.task = {name = "t", transpose_count = 0 : i64}}
module {
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @body(%arg0, %arg1) {mm.task = {name = "t", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @body(%a: tensor<8xf32>, %b: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %b : tensor<8xf32>
    %1 = stablehlo.add %0, %a : tensor<8xf32>
    %2 = stablehlo.add %1, %a : tensor<8xf32>
    %3 = stablehlo.add %2, %a : tensor<8xf32>
    %4 = stablehlo.add %3, %a : tensor<8xf32>
    %5 = stablehlo.add %4, %a : tensor<8xf32>
    %6 = stablehlo.add %5, %a : tensor<8xf32>
    %7 = stablehlo.add %6, %a : tensor<8xf32>
    %8 = stablehlo.add %7, %a : tensor<8xf32>
    %9 = stablehlo.add %8, %a : tensor<8xf32>
    return %9 : tensor<8xf32>
  }
}
