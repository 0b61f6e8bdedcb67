// The error a collective call must throw on every rank alike: its message, with the test failed
// where the error is not marked agreed (rank-local), has another type, or is not thrown.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <string>

#include "locus/comm/error.hpp"

namespace locus::test {

// Runs fn and returns the message of the agreed E it throws ("" after a failure was recorded).
template <class E, class Fn>
std::string agreed_error(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    EXPECT_TRUE(e.agreed()) << "not agreed across the ranks: " << e.what();
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected another error type, got: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected an error, nothing was thrown";
  return "";
}

}  // namespace locus::test
