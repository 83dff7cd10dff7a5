// RUN: mm-opt %s -p 'builtin.module(mm-match-tasks{rules={"rules":[{"matcher":"(layer_1)(?![0-9])","task":{"devices":[6,7]}},{"matcher":"(layer\\d+)","matches":[{"match":"layer0","task":{"devices":[0,1],"axis_names":["x"],"axis_sizes":[2],"logical_axes":[["batch","x"]]}},{"match":"layer0","backprop":true,"task":{"name":"layer0_bwd","devices":[2,3]}},{"match":"layer1","task":{"devices":[4,5]}},{"match":"layer1","backprop":true,"task":{"devices":[4,5]}},{"match":"layer2","task":{"name":"layer1","devices":[6,7]}}]},{"matcher":"blk(\\d*)","task":{"devices":[0]}},{"matcher":"(head)","task":{"name":"t","devices":[0,1,2,3]}}]}})' --split-input-file --verify-diagnostics | filecheck %s

// Implicit tasks: ops are claimed by the JAX name stack in their location. The
// rules (inline JSON) are tried in order; the first capture group is the matched
// name. Forward ops (no transpose(jvp ...) in the stack) get transpose_count 0,
// backward ops 1, and every task used joins the module's mm.tasks table; a backward
// named apart from its forward (layer0_bwd for the match layer0) records the forward.
// Prefix pitfall: a plain "layer_1" would also claim layer_10; the first rule is
// anchored with a negative lookahead, so layer_10 stays unclaimed.
// CHECK: module attributes {mm.tasks = {layer0 = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = {{\[\["batch", "x"\]\]}}}, layer0_bwd = {axis_names = ["x"], axis_sizes = [2], devices = [2, 3], forward = "layer0", logical_axes = {{\[\["x", "x"\]\]}}}, layer1 = {axis_names = ["x"], axis_sizes = [2], devices = [4, 5], logical_axes = {{\[\["x", "x"\]\]}}}, layer_1 = {axis_names = ["x"], axis_sizes = [2], devices = [6, 7], logical_axes = {{\[\["x", "x"\]\]}}}}}
// CHECK-LABEL: func.func @main
// CHECK-NEXT: stablehlo.sine %arg0 {mm.task = {name = "layer0", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.cosine %{{.*}} {mm.task = {name = "layer1", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.negate %{{.*}} {mm.task = {name = "layer0_bwd", transpose_count = 1 : i64}}
// CHECK-NEXT: stablehlo.abs %{{.*}} {mm.task = {name = "layer_1", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.exponential %{{[^ ]*}} : tensor<8xf32>
// CHECK-NEXT: stablehlo.add %{{.*}}, %{{[^ ]*}} : tensor<8xf32>
// CHECK-NEXT: stablehlo.multiply %{{.*}} {mm.task = {name = "layer1", transpose_count = 0 : i64}}
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 : tensor<8xf32> loc("jit(f)/jvp(layer0)/sin")
    %1 = stablehlo.cosine %0 : tensor<8xf32> loc("cosine:"("jit(f)/jvp(layer1)/cos"("model.py":3:1)))
    %2 = stablehlo.negate %1 : tensor<8xf32> loc("jit(f)/transpose(jvp(layer0))/neg")
    %3 = stablehlo.abs %2 : tensor<8xf32> loc("jit(f)/layer_1/abs")
    %4 = stablehlo.exponential %3 : tensor<8xf32> loc("jit(f)/layer_10/exp")
    %5 = stablehlo.add %4, %4 : tensor<8xf32> loc("jit(f)/add")
    %6 = stablehlo.multiply %5, %5 {mm.task = {name = "layer1", transpose_count = 0 : i64}} : tensor<8xf32> loc("jit(f)/layer0/mul")
    return %6 : tensor<8xf32>
  }
}

// -----

// Explicit task calls win: the body of task 't' is never matched, even inside a
// matching scope. Callee ops carry names relative to their call site, so they are
// matched as "<call site stack>/<own name>" (ops without a name take the call
// site's). A callee tagged differently at different call sites is cloned per call
// site; the call outside every scope keeps the original, untagged body, and so
// does the explicit task's callee, which a plain call also uses.
// CHECK: module attributes {mm.tasks = {layer0 = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = {{\[\["batch", "x"\]\]}}}, layer1 = {axis_names = ["x"], axis_sizes = [2], devices = [4, 5], logical_axes = {{\[\["x", "x"\]\]}}}}} {
// CHECK-LABEL: func.func @main
// CHECK-NEXT: call @body(%arg0) {mm.task = {{{.*}}name = "t"
// CHECK-NEXT: call @helper_match1(
// CHECK-NEXT: call @helper_match2(
// CHECK-NEXT: call @helper(
// CHECK-NEXT: call @body_match1(
// CHECK-LABEL: func.func private @body(
// CHECK-NEXT: stablehlo.sine %arg0 : tensor<8xf32>
// CHECK-LABEL: func.func private @helper(
// CHECK-NEXT: stablehlo.constant dense
// CHECK-NEXT: stablehlo.multiply %arg0, %{{[^ ]*}} : tensor<8xf32>
// CHECK-LABEL: func.func private @helper_match1(
// CHECK-NEXT: stablehlo.constant {mm.task = {name = "layer0", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.multiply {{.*}} {mm.task = {name = "layer0", transpose_count = 0 : i64}}
// CHECK-LABEL: func.func private @helper_match2(
// CHECK-NEXT: stablehlo.constant {mm.task = {name = "layer1", transpose_count = 1 : i64}}
// CHECK-NEXT: stablehlo.multiply {{.*}} {mm.task = {name = "layer1", transpose_count = 1 : i64}}
// CHECK-LABEL: func.func private @body_match1(
// CHECK-NEXT: stablehlo.sine %arg0 {mm.task = {name = "layer1", transpose_count = 0 : i64}}
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @body(%arg0) {mm.task = {name = "t", transpose_count = 0 : i64, devices = [0, 1, 2, 3], axis_names = ["x"], axis_sizes = [4], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32> loc("jit(f)/layer0/mm_task")
    %1 = func.call @helper(%0) : (tensor<8xf32>) -> tensor<8xf32> loc("jit(f)/layer0/jit(helper)")
    %2 = func.call @helper(%1) : (tensor<8xf32>) -> tensor<8xf32> loc("jit(f)/transpose(jvp(layer1))/jit(helper)")
    %3 = func.call @helper(%2) : (tensor<8xf32>) -> tensor<8xf32> loc("jit(f)/jit(helper)")
    %4 = func.call @body(%3) : (tensor<8xf32>) -> tensor<8xf32> loc("jit(f)/layer1/jit(body)")
    return %4 : tensor<8xf32>
  }
  func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 : tensor<8xf32> loc("sin")
    return %0 : tensor<8xf32>
  }
  func.func private @helper(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %cst = stablehlo.constant dense<2.0> : tensor<8xf32>
    %0 = stablehlo.multiply %arg0, %cst : tensor<8xf32> loc("mul")
    return %0 : tensor<8xf32>
  }
}

// -----

// Nested callees: the plan of a callee includes the plans of the calls inside it,
// so the layer1 copy of @outer calls its own copy of @inner.
// CHECK-LABEL: func.func @main
// CHECK-NEXT: call @outer(%arg0)
// CHECK-NEXT: call @outer_match1(
// CHECK-LABEL: func.func private @outer(
// CHECK-NEXT: stablehlo.negate %arg0 {mm.task = {name = "layer0", transpose_count = 0 : i64}}
// CHECK-NEXT: call @inner(
// CHECK-LABEL: func.func private @inner(
// CHECK-NEXT: stablehlo.sine %arg0 {mm.task = {name = "layer0", transpose_count = 0 : i64}}
// CHECK-LABEL: func.func private @outer_match1(
// CHECK-NEXT: stablehlo.negate %arg0 {mm.task = {name = "layer1", transpose_count = 0 : i64}}
// CHECK-NEXT: call @inner_match1(
// CHECK-LABEL: func.func private @inner_match1(
// CHECK-NEXT: stablehlo.sine %arg0 {mm.task = {name = "layer1", transpose_count = 0 : i64}}
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @outer(%arg0) : (tensor<8xf32>) -> tensor<8xf32> loc("jit(f)/layer0/jit(outer)")
    %1 = func.call @outer(%0) : (tensor<8xf32>) -> tensor<8xf32> loc("jit(f)/layer1/jit(outer)")
    return %1 : tensor<8xf32>
  }
  func.func private @outer(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.negate %arg0 : tensor<8xf32> loc("neg")
    %1 = func.call @inner(%0) : (tensor<8xf32>) -> tensor<8xf32> loc("jit(inner)")
    return %1 : tensor<8xf32>
  }
  func.func private @inner(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 : tensor<8xf32> loc("sin")
    return %0 : tensor<8xf32>
  }
}

// -----

// Regions: a claimed while keeps its body as is (the body belongs to it); in an
// unclaimed while, the body's ops are matched one by one.
// CHECK: module attributes {mm.tasks = {layer0 = {{.*}}, layer1 = {{.*}}}}
// CHECK-LABEL: func.func @main
// CHECK: %[[W0:.*]]:2 = stablehlo.while({{.*}}) : tensor<i32>, tensor<8xf32>{{$}}
// CHECK: } do {
// CHECK-NEXT: stablehlo.cosine %{{.*}} {mm.task = {name = "layer1", transpose_count = 0 : i64}}
// CHECK-NEXT: stablehlo.constant dense<1>
// CHECK-NEXT: stablehlo.add %{{[^ ]*}}, %{{[^ ]*}} : tensor<i32>
// CHECK: stablehlo.while({{.*}}) : tensor<i32>, tensor<8xf32> attributes {mm.task = {name = "layer0", transpose_count = 0 : i64}}
// CHECK: } do {
// CHECK-NEXT: stablehlo.sine %{{[^ ]*}} : tensor<8xf32>
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %c0 = stablehlo.constant dense<0> : tensor<i32>
    %0:2 = stablehlo.while(%i = %c0, %x = %arg0) : tensor<i32>, tensor<8xf32>
      cond {
        %c4 = stablehlo.constant dense<4> : tensor<i32>
        %p = stablehlo.compare LT, %i, %c4 : (tensor<i32>, tensor<i32>) -> tensor<i1>
        stablehlo.return %p : tensor<i1>
      } do {
        %y = stablehlo.cosine %x : tensor<8xf32> loc("jit(f)/while/body/layer1/cos")
        %c1 = stablehlo.constant dense<1> : tensor<i32>
        %j = stablehlo.add %i, %c1 : tensor<i32> loc("jit(f)/while/body/add")
        stablehlo.return %j, %y : tensor<i32>, tensor<8xf32>
      } loc("jit(f)/while")
    %1:2 = stablehlo.while(%i = %c0, %x = %0#1) : tensor<i32>, tensor<8xf32>
      cond {
        %c4 = stablehlo.constant dense<4> : tensor<i32>
        %p = stablehlo.compare LT, %i, %c4 : (tensor<i32>, tensor<i32>) -> tensor<i1>
        stablehlo.return %p : tensor<i1>
      } do {
        %y = stablehlo.sine %x : tensor<8xf32> loc("jit(f)/layer0/while/body/sin")
        %c1 = stablehlo.constant dense<1> : tensor<i32>
        %j = stablehlo.add %i, %c1 : tensor<i32>
        stablehlo.return %j, %y : tensor<i32>, tensor<8xf32>
      } loc("jit(f)/layer0/while")
    return %1#1 : tensor<8xf32>
  }
}

// -----

module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    // expected-error@unknown {{matcher 'blk(\d*)' produced an empty match on the op name stack 'jit(f)/blk/sin'}}
    %0 = stablehlo.sine %arg0 : tensor<8xf32> loc("jit(f)/blk/sin")
    return %0 : tensor<8xf32>
  }
}

// -----

module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    // expected-error@unknown {{matcher '(layer\d+)' matched 'layer3' (forward) but the rules give no task for it}}
    %0 = stablehlo.sine %arg0 : tensor<8xf32> loc("jit(f)/layer3/sin")
    return %0 : tensor<8xf32>
  }
}

// -----

module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 : tensor<8xf32> loc("jit(f)/layer1/sin")
    // expected-error@unknown {{task 'layer1' was given two different submeshes: match 'layer1' (forward) of matcher '(layer\d+)' puts it on devices [4, 5] (x=2)}}
    %1 = stablehlo.cosine %0 : tensor<8xf32> loc("jit(f)/layer2/cos")
    return %1 : tensor<8xf32>
  }
}

// -----

module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @body(%arg0) {mm.task = {name = "t", transpose_count = 0 : i64, devices = [4, 5, 6, 7], axis_names = ["x"], axis_sizes = [4], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32>
    // expected-error@unknown {{task 't' was given two different submeshes: an explicit task call puts it on devices [4, 5, 6, 7] (x=4)}}
    %1 = stablehlo.negate %0 : tensor<8xf32> loc("jit(f)/head/neg")
    return %1 : tensor<8xf32>
  }
  func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
