// RUN: mm-opt %s -p 'builtin.module(mm-outline-fragments)' --split-input-file --verify-diagnostics | filecheck %s

// One fragment per (task, direction) in dependency order: @main keeps only the
// fragment calls and the return; each fragment is private with mm.devices, mm.mesh
// and mm.task. The constant of a, also used by b, is cloned into b's fragment.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[AF:.*]] = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
// CHECK-NEXT: %[[BF:.*]] = call @b_fwd(%[[AF]]) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
// CHECK-NEXT: %[[BB:.*]] = call @b_bwd(%[[BF]]) {mm.fragment}
// CHECK-NEXT: %[[AB:.*]] = call @a_bwd(%[[BB]], %[[AF]]) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
// CHECK-NEXT: return %[[BF]], %[[AB]]
// CHECK-NEXT: }
// CHECK-NEXT: func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[C:.*]] = stablehlo.constant {mm.task = {name = "a", transpose_count = 0 : i64}} dense<2.000000e+00>
// CHECK-NEXT: %[[M:.*]] = stablehlo.multiply %arg0, %[[C]]
// CHECK-NEXT: return %[[M]]
// CHECK: func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[S:.*]] = stablehlo.sine %arg0
// CHECK-NEXT: %[[C2:.*]] = stablehlo.constant {mm.task = {name = "b", transpose_count = 0 : i64}} dense<2.000000e+00>
// CHECK-NEXT: %[[A:.*]] = stablehlo.add %[[S]], %[[C2]]
// CHECK-NEXT: return %[[A]]
// CHECK: func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64}}
// CHECK-NEXT: stablehlo.cosine %arg0
// CHECK: func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64}}
// CHECK-NEXT: stablehlo.multiply %arg0, %arg1
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, b = {devices = [2, 3], axis_names = ["y"], axis_sizes = [2], logical_axes = []}}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %c = stablehlo.constant {mm.task = {name = "a", transpose_count = 0 : i64}} dense<2.0> : tensor<8xf32>
    %0 = stablehlo.multiply %arg0, %c {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<8xf32>
    %1 = stablehlo.sine %0 {mm.task = {name = "b", transpose_count = 0 : i64}} : tensor<8xf32>
    %2 = stablehlo.add %1, %c {mm.task = {name = "b", transpose_count = 0 : i64}} : tensor<8xf32>
    %3 = stablehlo.cosine %2 {mm.task = {name = "b", transpose_count = 1 : i64}} : tensor<8xf32>
    %4 = stablehlo.multiply %3, %0 {mm.task = {name = "a", transpose_count = 1 : i64}} : tensor<8xf32>
    return %2, %4 : tensor<8xf32>, tensor<8xf32>
  }
}

// -----

// A single task: one fragment holding every op.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[F:.*]] = call @a_fwd(%arg0) {mm.fragment}
// CHECK-NEXT: return %[[F]]
// CHECK: func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[N:.*]] = stablehlo.negate %arg0
// CHECK-NEXT: %[[S:.*]] = stablehlo.sine %[[N]]
// CHECK-NEXT: return %[[S]]
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  sdy.mesh @mesh_a = <["x"=2]>
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.negate %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<8xf32>
    %1 = stablehlo.sine %0 {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
}

// -----

// Without sdy.mesh ops in the input, the pass creates one sdy.mesh @mesh_<task>
// per task that has a fragment, before @main.
// CHECK-LABEL: module attributes {mm.tasks
// CHECK-NEXT: sdy.mesh @mesh_a = <["x"=2]>
// CHECK-NEXT: sdy.mesh @mesh_b = <["y"=4]>
// CHECK-NEXT: func.func @main
// CHECK-NEXT: %[[A:.*]] = call @a_fwd(%arg0) {mm.fragment}
// CHECK-NEXT: call @b_fwd(%[[A]]) {mm.fragment}
// CHECK: func.func private @a_fwd({{.*}} attributes {mm.devices = [0, 1], mm.mesh = @mesh_a,
// CHECK: func.func private @b_fwd({{.*}} attributes {mm.devices = [2, 3, 4, 5], mm.mesh = @mesh_b,
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, b = {devices = [2, 3, 4, 5], axis_names = ["y"], axis_sizes = [4], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.negate %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<8xf32>
    %1 = stablehlo.sine %0 {mm.task = {name = "b", transpose_count = 0 : i64}} : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
}

// -----

module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  sdy.mesh @mesh_a = <["x"=2]>
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.negate %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<8xf32>
    // expected-error@+1 {{op is not assigned to a task; run mm-assign-tasks first}}
    %1 = stablehlo.sine %0 : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
}

// -----

// A microbatch loop: fragments never mix ops of the loop with ops outside it. The
// index stays in @main and becomes an argument of the loop fragment that reads it;
// the sum stays too, right after the call that makes what it sums, and what reads
// the sum comes after it.
// CHECK-LABEL: func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<2xf32>)
// CHECK-NEXT: %[[I:.*]] = stablehlo.custom_call @mm.microbatch_index()
// CHECK-NEXT: %[[W:.*]] = call @a_fwd(%arg1) {mm.fragment}
// CHECK-NEXT: %[[L:.*]] = call @a_fwd_1(%arg0, %[[I]], %[[W]]) {mm.fragment}
// CHECK-NEXT: %[[S:.*]] = stablehlo.custom_call @mm.microbatch_sum(%[[L]])
// CHECK-NEXT: %[[P:.*]] = call @a_fwd_2(%[[S]], %[[W]]) {mm.fragment}
// CHECK-NEXT: return %[[S]], %[[P]]
// CHECK: func.func private @a_fwd_1(%arg0: tensor<8xf32>, %arg1: tensor<i32>, %arg2: tensor<2xf32>) -> tensor<2xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {loop = 0 : i64, name = "a", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.dynamic_slice %arg0, %arg1
module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<2xf32>) -> (tensor<2xf32>, tensor<2xf32>) {
    %w = stablehlo.negate %arg1 {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<2xf32>
    %0 = stablehlo.custom_call @mm.microbatch_index() {mm.loop = 0 : i64} : () -> tensor<i32>
    %1 = stablehlo.dynamic_slice %arg0, %0, sizes = [2] {mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} : (tensor<8xf32>, tensor<i32>) -> tensor<2xf32>
    %2 = stablehlo.multiply %1, %w {mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} : tensor<2xf32>
    %3 = stablehlo.custom_call @mm.microbatch_sum(%2) {mm.microbatch = {loop = 0 : i64, num_microbatches = 4 : i64}} : (tensor<2xf32>) -> tensor<2xf32>
    %4 = stablehlo.add %3, %w {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<2xf32>
    return %3, %4 : tensor<2xf32>, tensor<2xf32>
  }
}

// -----

// A leaf task call (flat form) is outlined as one op and becomes its body inside its
// fragment, next to the glue op of its task; the callee is gone.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[F:.*]] = call @t_fwd(%arg0) {mm.fragment}
// CHECK-NEXT: return %[[F]]
// CHECK: func.func private @t_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32>
// CHECK-NEXT: %[[N:.*]] = stablehlo.negate %arg0 {mm.task = {name = "t", transpose_count = 0 : i64}}
// CHECK-NEXT: %[[C:.*]] = sdy.sharding_constraint %[[N]] <@mesh_t, [{}]>
// CHECK-NEXT: %[[S:.*]] = stablehlo.sine %[[C]] : tensor<8xf32>
// CHECK-NEXT: return %[[S]]
// CHECK-NOT: @body
module attributes {mm.tasks = {t = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  sdy.mesh @mesh_t = <["x"=2]>
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.negate %arg0 {mm.task = {name = "t", transpose_count = 0 : i64}} : tensor<8xf32>
    %1 = call @body(%0) {mm.task = {name = "t", transpose_count = 0 : i64}} : (tensor<8xf32>) -> tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.task = {name = "t", transpose_count = 0 : i64}} {
    %0 = sdy.sharding_constraint %arg0 <@mesh_t, [{}]> : tensor<8xf32>
    %1 = stablehlo.sine %0 : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
}

// -----

// A leaf call of a task that already has a fragment, needing a value from a later
// fragment, is placed op by op, as its inlined body would be: the add reads only
// earlier values and joins t's first fragment; the multiply opens t_fwd_1.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: %[[A:.*]]:2 = call @t_fwd(%arg0) {mm.fragment}
// CHECK-NEXT: %[[B:.*]] = call @u_fwd(%[[A]]#0) {mm.fragment}
// CHECK-NEXT: %[[C:.*]] = call @t_fwd_1(%[[A]]#1, %[[B]]) {mm.fragment}
// CHECK: func.func private @t_fwd(
// CHECK-NEXT: stablehlo.negate
// CHECK-NEXT: stablehlo.add %{{.*}} {mm.task = {name = "t", transpose_count = 0 : i64}}
// CHECK: func.func private @t_fwd_1(
// CHECK-NEXT: stablehlo.multiply %arg0, %arg1 {mm.task = {name = "t", transpose_count = 0 : i64}}
// CHECK-NOT: @tb
module attributes {mm.tasks = {t = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, u = {devices = [2, 3], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.negate %arg0 {mm.task = {name = "t", transpose_count = 0 : i64}} : tensor<8xf32>
    %1 = stablehlo.sine %0 {mm.task = {name = "u", transpose_count = 0 : i64}} : tensor<8xf32>
    %2 = call @tb(%0, %1) {mm.task = {name = "t", transpose_count = 0 : i64}} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %2 : tensor<8xf32>
  }
  func.func private @tb(%a: tensor<8xf32>, %b: tensor<8xf32>) -> tensor<8xf32> attributes {mm.task = {name = "t", transpose_count = 0 : i64}} {
    %c = stablehlo.add %a, %a : tensor<8xf32>
    %d = stablehlo.multiply %c, %b : tensor<8xf32>
    return %d : tensor<8xf32>
  }
}
