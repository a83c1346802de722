// EXPECT_RINGFLASH_ERROR(ErrorType, statement, substrings...): the statement throws exactly that
// ringflash error type (not merely another Error), and its message contains every substring.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <initializer_list>
#include <string>

#include "ringflash/errors.h"

namespace ringflash::test {

template <typename ErrorType, typename Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> substrings, const char* file, int line) {
  try {
    fn();
  } catch (const ErrorType& e) {
    const std::string message = e.what();
    for (const std::string& s : substrings)
      if (message.find(s) == std::string::npos)
        ADD_FAILURE_AT(file, line) << "the message lacks \"" << s << "\":\n  " << message;
    return;
  } catch (const Error& e) {
    ADD_FAILURE_AT(file, line) << "threw a different ringflash error type: " << e.what();
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE_AT(file, line) << "threw a non-ringflash exception: " << e.what();
    return;
  }
  ADD_FAILURE_AT(file, line) << "threw nothing";
}

}  // namespace ringflash::test

#define EXPECT_RINGFLASH_ERROR(ErrorType, statement, ...) \
  ::ringflash::test::expect_error<::ringflash::ErrorType>([&] { statement; }, {__VA_ARGS__}, __FILE__, __LINE__)
