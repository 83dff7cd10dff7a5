// RUN: mm-opt %s --split-input-file --verify-diagnostics
// RUN: mm-opt %s -p 'builtin.module(mm-verify)' --split-input-file --verify-diagnostics

// Every directive form of MLIR's --verify-diagnostics; line numbers are those of
// this file even though each chunk is parsed separately.

func.func @bare() {
  %0 = foo // expected-error {{custom op 'foo' is unknown}}
}

// -----

func.func @plus() {
  // expected-error@+1 {{custom op 'bar' is unknown}}
  %0 = bar
}

// -----

func.func @minus() {
  %0 = baz
  // expected-error@-1 {{custom op 'baz' is unknown}}
}

// -----

func.func @below() {
  // @below and @above name the next/previous line without a directive.
  // expected-error@below {{custom op 'qux' is unknown}}
  %0 = qux
}

// -----

func.func @above() {
  %0 = quux
  // expected-error@above {{custom op 'quux' is unknown}}
}

// -----

func.func @regex() {
  // expected-error-re@+1 {{custom op '{{[a-z]+}}' is {{(unknown|not known)}}}}
  %0 = corge
}
