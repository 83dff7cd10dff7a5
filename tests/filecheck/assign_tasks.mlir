// RUN: mm-opt %s -p 'builtin.module(mm-assign-tasks{num-devices=8})' --split-input-file --verify-diagnostics | filecheck %s

// Untagged ops join the task they exchange the most bytes with: the slice reads
// 256 bytes from b and sends 32 bytes to a's backward, so it joins b; the negate
// reads 32 bytes from a (forward) and sends 32 bytes to a (backward), and the tie
// goes to the earliest neighbour. Tagged ops and the task table are unchanged
// (no mm.default).
// CHECK: module attributes {mm.tasks = {a = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = []}, b = {axis_names = ["x"], axis_sizes = [2], devices = [2, 3], logical_axes = []}}} {
// CHECK-LABEL: func.func @main
// CHECK-NEXT: stablehlo.sine %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.cosine %arg1 {mm.task = {name = "b", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.slice %{{.*}} [0:8] {mm.task = {name = "b", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.negate %{{.*}} {mm.task = {name = "a", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.add %{{.*}}, %{{.*}} {mm.task = {name = "a", transpose_count = 1 : i64}}
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, b = {devices = [2, 3], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<64xf32>) -> (tensor<8xf32>, tensor<64xf32>) {
    %0 = stablehlo.sine %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<8xf32>
    %1 = stablehlo.cosine %arg1 {mm.task = {name = "b", transpose_count = 0 : i64}} : tensor<64xf32>
    %2 = stablehlo.slice %1 [0:8] : (tensor<64xf32>) -> tensor<8xf32>
    %3 = stablehlo.negate %0 : tensor<8xf32>
    %4 = stablehlo.add %2, %3 {mm.task = {name = "a", transpose_count = 1 : i64}} : tensor<8xf32>
    return %4, %1 : tensor<8xf32>, tensor<64xf32>
  }
}

// -----

// A program with no task at all: every op goes to the implicit task mm.default on
// all num-devices devices, with no logical mapping.
// CHECK: module attributes {mm.tasks = {mm.default = {axis_names = ["x"], axis_sizes = [8], devices = [0, 1, 2, 3, 4, 5, 6, 7], logical_axes = []}}}
// CHECK-LABEL: func.func @main
// CHECK-NEXT: stablehlo.sine %arg0 {mm.task = {name = "mm.default", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.add %{{.*}}, %{{.*}} {mm.task = {name = "mm.default", transpose_count = 0 : i64}}
// CHECK-NEXT: return
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    %1 = stablehlo.add %0, %0 : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
}

// -----

// The caller may give mm.default its mesh (mjit(mesh=...), a MultiMesh): the entry
// stays, and the ops go to it.
// CHECK: module attributes {mm.tasks = {mm.default = {axis_names = ["x", "y"], axis_sizes = [4, 2], devices = [0, 1, 2, 3, 4, 5, 6, 7], logical_axes = []}}}
// CHECK-LABEL: func.func @main
// CHECK-NEXT: stablehlo.sine %arg0 {mm.task = {name = "mm.default", transpose_count = 0 : i64}}
module attributes {mm.tasks = {mm.default = {devices = [0, 1, 2, 3, 4, 5, 6, 7], axis_names = ["x", "y"], axis_sizes = [4, 2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// A while op whose body holds tagged ops takes their task (the body ops keep only
// their own tags), and its untagged neighbours then follow it (no mm.default).
// CHECK: module attributes {mm.tasks = {loop = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = []}}} {
// CHECK-LABEL: func.func @main
// CHECK-NEXT: stablehlo.constant {mm.task = {name = "loop", transpose_count = 0 : i64}} dense<0>
// CHECK-NEXT: stablehlo.while({{.*}}) : tensor<i32>, tensor<8xf32> attributes {mm.task = {name = "loop", transpose_count = 0 : i64}}
// CHECK: cond {
// CHECK-NEXT: stablehlo.constant dense<4> : tensor<i32>
// CHECK: } do {
// CHECK-NEXT: stablehlo.cosine %{{.*}} {mm.task = {name = "loop", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.constant dense<1> : tensor<i32>
// CHECK: stablehlo.negate %{{.*}}#1 {mm.task = {name = "loop", transpose_count = 0 : i64}}
module attributes {mm.tasks = {loop = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %c0 = stablehlo.constant dense<0> : tensor<i32>
    %0:2 = stablehlo.while(%i = %c0, %x = %arg0) : tensor<i32>, tensor<8xf32>
      cond {
        %c4 = stablehlo.constant dense<4> : tensor<i32>
        %p = stablehlo.compare LT, %i, %c4 : (tensor<i32>, tensor<i32>) -> tensor<i1>
        stablehlo.return %p : tensor<i1>
      } do {
        %y = stablehlo.cosine %x {mm.task = {name = "loop", transpose_count = 0 : i64}} : tensor<8xf32>
        %c1 = stablehlo.constant dense<1> : tensor<i32>
        %j = stablehlo.add %i, %c1 : tensor<i32>
        stablehlo.return %j, %y : tensor<i32>, tensor<8xf32>
      }
    %1 = stablehlo.negate %0#1 : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
}

// -----

// Two tasks on different submeshes inside one while body are an error.
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, b = {devices = [2, 3], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %c0 = stablehlo.constant dense<0> : tensor<i32>
    %0:2 = stablehlo.while(%i = %c0, %x = %arg0) : tensor<i32>, tensor<8xf32>
      cond {
        %c4 = stablehlo.constant dense<4> : tensor<i32>
        %p = stablehlo.compare LT, %i, %c4 : (tensor<i32>, tensor<i32>) -> tensor<i1>
        stablehlo.return %p : tensor<i1>
      } do {
        %y = stablehlo.cosine %x {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<8xf32>
        // expected-error@+1 {{tasks 'a' and 'b' run on different submeshes but sit inside the same 'stablehlo.while'; a loop body runs on one submesh}}
        %z = stablehlo.sine %y {mm.task = {name = "b", transpose_count = 0 : i64}} : tensor<8xf32>
        %c1 = stablehlo.constant dense<1> : tensor<i32>
        %j = stablehlo.add %i, %c1 : tensor<i32>
        stablehlo.return %j, %z : tensor<i32>, tensor<8xf32>
      }
    return %0#1 : tensor<8xf32>
  }
}

// -----

// In a microbatch loop an untagged op keeps its own loop (its mm.loop moves into the
// tag) and joins its heaviest neighbour's task; the loop markers get no task.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[I:.*]] = stablehlo.custom_call @mm.microbatch_index() {mm.loop = 0 : i64}
// CHECK-NEXT: stablehlo.dynamic_slice %arg0, %[[I]], sizes = [2] {mm.task = {loop = 0 : i64, name = "t", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.sine %{{.*}} {mm.task = {loop = 0 : i64, name = "t", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[S:.*]] = stablehlo.custom_call @mm.microbatch_sum(%{{.*}}) {mm.microbatch = {loop = 0 : i64, num_microbatches = 4 : i64}}
// CHECK-NEXT: stablehlo.negate %[[S]] {mm.task = {name = "t", transpose_count = 0 : i64}}
module attributes {mm.tasks = {t = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<2xf32> {
    %0 = stablehlo.custom_call @mm.microbatch_index() {mm.loop = 0 : i64} : () -> tensor<i32>
    %1 = stablehlo.dynamic_slice %arg0, %0, sizes = [2] {mm.loop = 0 : i64} : (tensor<8xf32>, tensor<i32>) -> tensor<2xf32>
    %2 = stablehlo.sine %1 {mm.task = {name = "t", transpose_count = 0 : i64, loop = 0 : i64}} : tensor<2xf32>
    %3 = stablehlo.custom_call @mm.microbatch_sum(%2) {mm.microbatch = {loop = 0 : i64, num_microbatches = 4 : i64}} : (tensor<2xf32>) -> tensor<2xf32>
    %4 = stablehlo.negate %3 : tensor<2xf32>
    return %4 : tensor<2xf32>
  }
}

// -----

// A leaf task call counts a value once per op of its body that reads it (as if the
// body were inlined): the glue joins `a`, whose body reads it twice, rather than the
// earlier single read by `b`.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: stablehlo.negate %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}}
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, b = {devices = [2, 3], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = stablehlo.negate %arg0 : tensor<8xf32>
    %1 = stablehlo.sine %0 {mm.task = {name = "b", transpose_count = 0 : i64}} : tensor<8xf32>
    %2 = call @abody(%0) {mm.task = {name = "a", transpose_count = 0 : i64}} : (tensor<8xf32>) -> tensor<8xf32>
    return %1, %2 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @abody(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.task = {name = "a", transpose_count = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// Ops of a backward pass (transpose(jvp(...)) in their name) first spread among
// backward tasks alone: the negate reads a's forward result (its only tagged
// neighbour at first) but joins b's backward through the add_any, as the loss's
// backward joins the head's; before, it took a's forward and ran there as forward.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: stablehlo.sine %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.negate %{{.*}} {mm.task = {name = "b", transpose_count = 1 : i64}}
// CHECK-NEXT: stablehlo.add %{{.*}}, %{{.*}} {mm.task = {name = "b", transpose_count = 1 : i64}}
// CHECK-NEXT: stablehlo.multiply %{{.*}}, %{{.*}} {mm.task = {name = "b", transpose_count = 1 : i64}}
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, b = {devices = [2, 3], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<8xf32>
    %1 = stablehlo.negate %0 : tensor<8xf32> loc("transpose(jvp(m))/jit(log_softmax)/neg")
    %2 = stablehlo.add %1, %1 : tensor<8xf32> loc("transpose(jvp(m))/jit(log_softmax)/add_any")
    %3 = stablehlo.multiply %2, %2 {mm.task = {name = "b", transpose_count = 1 : i64}} : tensor<8xf32>
    return %3 : tensor<8xf32>
  }
}
